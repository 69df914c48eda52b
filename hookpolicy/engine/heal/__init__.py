"""The engine's healing of a step: `then: cool_down` and `then: rewind`, and the snapshots a rewind goes back to.

Takes an agreed decision (`decide`); gives the heal a step takes (`healing`) and the in-memory
snapshots of the model and what moves with it (`snapshots`). Imports `hooks`, `measure`,
`execute` and `decide` of the engine.
"""
