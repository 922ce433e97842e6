"""The planner's cost model: hardware profiles, the predicted time of one step, the calibration.

- :mod:`train.planning.profiles`: :class:`Profile`, :func:`load_profile` (``h100``, ``h200``, ``a100``,
  ``cpu``: ``train/planning/profiles/*.toml``, every number with its source);
- :mod:`train.planning.cost`: :class:`Workload`, :func:`step_flops`, :func:`axis_link`,
  :func:`predict` -> :class:`Prediction` (``step_s``, ``tokens_per_s_per_device``, ``mfu``,
  ``bottleneck``), from the bytes per collective and mesh axis of a compiled program
  (:func:`traffic_of_report`) or of the formulas (:func:`formula_traffic`);
- :mod:`train.planning.calibrate`: ``python -m train.planning.calibrate`` measures this machine's
  profile (a matmul, an all-gather, a reduce-scatter and a copy on the emulated devices).

docs/planning.md, "Predicted step time", describes the model and the source of every constant.
"""

from train.planning.cost import (Prediction, Workload, axis_link, collective_seconds, formula_traffic, predict, step_flops,
                                 traffic_of_report)
from train.planning.profiles import Profile, load_profile, profile_names

__all__ = ["Prediction", "Profile", "Workload", "axis_link", "collective_seconds", "formula_traffic", "load_profile", "predict",
           "profile_names", "step_flops", "traffic_of_report"]
