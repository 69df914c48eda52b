"""The engine's decision at a step: the read-back, the alerts, and the agreement of every rank.

Takes the step's record (`execute.ledger`); gives what the read-back published and decided
(`readback`, grouping and finishing each pass in `passes`; `alerts`, with the `StepReport`), the
output writers (`writers`), and the ranks' part: one agreement collective (`agreement`, which also
reduces the `ranks: job` statistics) and the series a job exports once (`replicas`). Imports `hooks`, `measure` and `execute` of the engine.
"""
