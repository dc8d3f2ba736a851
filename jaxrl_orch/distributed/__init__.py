"""A run over several processes (docs/design.md section 8): the process group and its roles
(``group``), the engine replicas, each an engine behind the HTTP contract of ``serving``
(``replica``, with ``source`` its one weight source), the orchestrator's client of them and its
pool (``client``, ``pool``), cross-process weights (the default transport: ``offer_wire``,
``offer_server``, ``offer_pull``; the opt-in: ``transfer``), the command line's addresses
(``addresses``), what the platform's environment says of them (``platform``) and the local
launcher (``launch_local``)."""
