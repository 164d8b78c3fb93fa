"""The reporting wing (being split by idea: tables, plots, Hydra callbacks, over-optimisation fits)."""

from prefzoo.report.plots import *  # noqa: F401,F403  (the whole former prefzoo/report.py, split next)
from prefzoo.report.plots import load_runs, main, markdown_table, swept_keys, write_report  # noqa: F401
