"""Switch the course's tracer on in every Python process started with COURSE_TRACE=DIR and this folder on
PYTHONPATH: torchrun's workers and mp.spawn's children are fresh interpreters, and Python imports a
`sitecustomize` module from its path at start-up. tools/tracer.py says what is recorded."""

import os

if os.environ.get("COURSE_TRACE"):
    import sys

    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tools import tracer

    tracer.install(os.environ["COURSE_TRACE"])
