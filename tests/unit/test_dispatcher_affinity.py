"""A multi-turn episode's turns stick to the engine of its first turn (rollout.dispatcher pins):
they wait for it while it is busy, never go to another engine then, and continue on any engine once
it is lost, drained or asleep."""

from __future__ import annotations

from rljob_trainer.rollout import dispatcher


def _two_engines() -> dispatcher.Dispatcher:
    d = dispatcher.Dispatcher(lambda: 0.0)
    d.set_engine("a", awake=True, capacity=4)
    d.set_engine("b", awake=True, capacity=4)
    return d


def test_a_pinned_turn_goes_to_its_engine_even_when_another_is_less_loaded() -> None:
    d = _two_engines()
    busy = d.submit(3)
    assert d.admit(engines=["a"]) == {"a": busy}  # a holds 3, b none
    (turn,) = d.submit(1, engine="a")
    plain = d.submit(1)
    assert d.pinned_to(turn) == "a"
    assert d.admit() == {"a": [turn], "b": plain}  # least loaded would have been b


def test_a_pinned_turn_waits_for_its_busy_engine_while_others_go() -> None:
    d = _two_engines()
    d.admit()
    (turn,) = d.submit(1, engine="a")
    plain = d.submit(2)
    assert d.admit(engines=["b"]) == {"b": plain}  # a is busy (not offered): the turn waits
    assert d.is_queued(turn)
    assert d.admit(engines=["a"]) == {"a": [turn]}


def test_a_full_engine_keeps_its_turns_queued() -> None:
    d = _two_engines()
    d.set_engine("a", awake=True, capacity=1)
    first = d.submit(1, engine="a")
    second = d.submit(1, engine="a")
    assert d.admit() == {"a": first}
    assert d.is_queued(second[0])  # b has room, but it is a's turn to serve
    d.finish(first)
    assert d.admit() == {"a": second}


def test_a_lost_engines_episodes_continue_elsewhere() -> None:
    d = _two_engines()
    (turn,) = d.submit(1, engine="a")
    assert d.admit(engines=["a"]) == {"a": [turn]}
    d.remove_engine("a")  # lost while generating the turn: requeued, unpinned
    assert d.is_queued(turn) and d.pinned_to(turn) is None
    assert d.admit() == {"b": [turn]}
    (later,) = d.submit(1, engine="a")  # an engine that is gone pins nothing
    assert d.pinned_to(later) is None


def test_a_sleeping_or_draining_engines_turns_go_elsewhere() -> None:
    d = _two_engines()
    (turn,) = d.submit(1, engine="a")
    d.set_engine("a", awake=False, capacity=4)
    assert d.admit() == {"b": [turn]}
    assert d.pinned_to(turn) is None


def test_finishing_a_request_drops_its_pin_and_requeue_keeps_it() -> None:
    d = _two_engines()
    (turn,) = d.submit(1, engine="b")
    d.admit()
    d.requeue([turn])  # interrupted at a weight sync: resumed on the same engine
    assert d.pinned_to(turn) == "b"
    assert d.admit() == {"b": [turn]}
    d.finish([turn])
    assert d.pinned_to(turn) is None
