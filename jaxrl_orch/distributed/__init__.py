"""A run over several processes (DESIGN.md section 8): the process group and its roles
(``group``), the engine replicas' request protocol, server, client and pool, cross-process
weight transfer (``transfer``), and the local launcher (``launch_local``)."""
