"""Python processes that a `pytest --cpu-target NAME` run starts compile for NAME too.

conftest.py puts this directory first on the suite's PYTHONPATH and NAME in
`MOKV_TEST_CPU_TARGET`; Python imports `sitecustomize` at start-up, before the test's
script runs, so each child sets MAX's virtual CPU target before it compiles anything.
Only during such a run, and at the price of shadowing an interpreter's own
`sitecustomize` (a plain venv has none).
"""

import os

_target = os.environ.get("MOKV_TEST_CPU_TARGET")
if _target:
    try:
        from max.driver import set_virtual_cpu_target
    except ImportError:  # an interpreter without MAX (the packaging test's bare venv)
        pass
    else:
        set_virtual_cpu_target(_target)
