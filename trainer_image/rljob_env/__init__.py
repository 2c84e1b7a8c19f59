"""Environment servers for multi-turn episodes (spec.environments[]): the reset/step protocol over HTTP.

Role: what runs in an environment pod (`python -m rljob_env.<name> --port N`), and the one home of
the protocol the trainer's environment client speaks (docs/contracts.md §4): `server` serves any
`Environment` (reset, step) as JSON over HTTP with the Python standard library only, so it runs in
the trainer image without torch, and in any image with a Python; `arithmetic` is the environment
shipped for tests and the examples, and `arithmetic_agent` the same game as an environment of mode
agent (its own agent plays each episode through the job's OpenAI-compatible endpoint).

Imports nothing of rljob_trainer, rljob_operator, torch or Ray (pyproject's import contracts).
"""
