"""The compiled programs: the train step (step.py) and its options and batch placement (step_config.py),
eval and forward (evaluate.py), the interception of the model's parameter reads (intercept.py) and the
unit calls (unit_call.py)."""
