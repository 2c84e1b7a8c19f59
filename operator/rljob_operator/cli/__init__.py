"""What a user runs: the `rljob` command (`commands`), `rljob status`/`logs` (`console`), `rljob render`.

The top layer: it may import everything below it; nothing imports it.
"""
