"""Commands beside the train command: the simulator (``simulate``), the deviceless TPU fit
check (``aot`` and its report), the run report (``report``) and the RL-lift study (``lift``).
Each is a ``[project.scripts]`` entry and a ``python -m jaxrl_orch.tools.NAME`` module."""
