"""The engine during a step: where steps begin and end, which hooks are in, and what their bodies record.

Takes the rules and their programs (`measure`); gives step boundaries (`steps`), the
module hooks of the active rules (`executor.HookInstaller`) whose bodies (`executor`, `programs`)
append to the step's record (`ledger`) with their faults contained (`programs.Faults`), the update's own targets
(`updates`) and the rules bound anew when the model changes (`executor.Rebinding`). Imports `hooks`
and `measure` of the engine.
"""
