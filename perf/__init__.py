"""Benchmarks, one per claim (not tests): each prints one JSON object and can write a PNG plot.

Run one as a script (``python perf/scheduler.py --quick``) or import it and call
``main(argv)``, which returns the result as a dict.
"""
