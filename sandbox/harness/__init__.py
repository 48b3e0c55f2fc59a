"""The files a sandboxed child runs: sandbox_worker.py (the script every child starts; the jobs, the dispatch
guard, the runtime helpers a candidate imports as `sandbox_worker`), driver.py (the trusted side of a check),
share.py (shared regions, GPU flags, the L2 controls, the freezer), measure.py (the task and its inputs), wire.py
(the channels), rules.py (static scan, comparison, timing statistic), inline.py (load_inline and form (c) in
the child) and guard.cpp (the dispatch guard's source, built on the host).

In a child these files are bound side by side (sandbox.child.HARNESS_FILES) and import each other by flat module
name; on the host they are modules of this package. Nothing here imports any other module of the project.
"""
