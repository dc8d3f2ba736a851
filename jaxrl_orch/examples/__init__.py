"""Tasksets written for other environment libraries, shipped as working examples.

``vf_reverse_text``, ``vf_two_turn`` and ``vf_tool_call`` are verifiers 0.4 tasksets (each with
the in-process chat harness of ``vf_chat``) that ``envs.vf`` loads by the ids in
``envs.vf.env.EXAMPLES``. They are user code: they import the library, never the reverse.
"""
