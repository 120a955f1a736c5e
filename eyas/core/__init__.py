"""The step's types, below every layer that passes them along: requests, the scheduler's plan and the runner's
result. Engine, runner and spec_decode import them; nothing here imports those."""
