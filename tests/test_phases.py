"""The pass-through's phases: one table per machine, and only one place that moves each.

An exchange's phase (passthrough/phases.py) and a connection to vLLM's state
(passthrough/upstream.py) change only through their tables: the tables are checked here for
what they must allow and forbid, and the code is read (its syntax tree) for any assignment
that would go around them.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from mla_serve.sidecar.passthrough import phases, upstream
from mla_serve.sidecar.passthrough.phases import MOVES, Phase, PhaseError, move
from mla_serve.sidecar.passthrough.upstream import State

ROOT = Path(__file__).resolve().parents[1]
PASSTHROUGH = ROOT / "mla_serve" / "sidecar" / "passthrough"


def reachable(moves: dict, start: object) -> set[object]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in moves[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_phase_is_reachable_and_done_is_final() -> None:
    assert reachable(MOVES, Phase.BODY) == set(Phase)
    assert MOVES[Phase.DONE] == frozenset()
    for phase in Phase:  # a client can leave (or be answered, or the drain end it) anywhere
        assert phase is Phase.DONE or Phase.DONE in MOVES[phase]
    # nothing goes back to reading a body, and a relayed response never goes back to vLLM
    assert all(Phase.BODY not in targets for targets in MOVES.values())
    assert MOVES[Phase.RELAY] == frozenset({Phase.DONE})


@pytest.mark.parametrize(
    ("current", "to"),
    [(Phase.RELAY, Phase.SENT), (Phase.DONE, Phase.RELAY), (Phase.BODY, Phase.RELAY),
     (Phase.QUEUED, Phase.BODY), (Phase.CONNECTING, Phase.CONNECTING)],
)  # fmt: skip
def test_a_move_the_table_has_not_is_refused_loudly(current: Phase, to: Phase) -> None:
    with pytest.raises(PhaseError, match=f"from {current.name} to {to.name}"):
        move(current, to)


def test_a_connection_goes_back_to_the_pool_only_from_done() -> None:
    assert reachable(upstream.MOVES, State.IDLE) == set(State)
    assert [s for s, targets in upstream.MOVES.items() if State.IDLE in targets] == [State.DONE]
    for state in State:
        assert State.CLOSED in upstream.MOVES[state]
    assert upstream.MOVES[State.CLOSED] == frozenset({State.CLOSED})


def _assignments(path: Path, attribute: str) -> list[tuple[str, ast.expr]]:
    """Every `self.<attribute> = value` in the file: (the enclosing function, the value)."""
    found: list[tuple[str, ast.expr]] = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and target.attr == attribute
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        found.append((function.name, node.value))
    return found


def test_the_exchange_moves_its_phase_only_through_the_table() -> None:
    """Outside its constructor, every assignment of an exchange's phase is `move(...)`, and no
    other module of the pass-through assigns a phase at all."""
    assigned = _assignments(PASSTHROUGH / "exchange.py", "phase")
    assert len(assigned) > 5
    for function, value in assigned:
        if function == "__init__":
            continue
        assert isinstance(value, ast.Call) and getattr(value.func, "id", None) == "move", (
            f"exchange.py {function}: the phase set without phases.move"
        )
    for path in [*PASSTHROUGH.glob("*.py"), ROOT / "mla_serve" / "sidecar" / "uvicorn_adapter.py"]:
        if path.name not in ("exchange.py", "phases.py"):
            assert not _assignments(path, "phase"), f"{path.name} sets an exchange's phase"


def test_a_connection_moves_its_state_only_through_its_table() -> None:
    assigned = _assignments(PASSTHROUGH / "upstream.py", "state")
    assert {function for function, _ in assigned} == {"__init__", "_to"}


def test_the_connection_refuses_a_move_its_table_has_not() -> None:
    async def go() -> None:
        pool = upstream.Pool("http://127.0.0.1:9", 1.0)
        conn = upstream.Connection(pool)
        with pytest.raises(RuntimeError, match="no move from IDLE to BODY"):
            conn._to(State.BODY)
        conn._to(State.CLOSED)
        with pytest.raises(RuntimeError, match="no move from CLOSED to IDLE"):
            conn._to(State.IDLE)

    asyncio.run(go())


def test_the_phase_table_is_the_one_the_docstring_draws() -> None:
    """Each phase named in the module's docstring, so the picture and the table agree."""
    doc = phases.__doc__ or ""
    for phase in Phase:
        assert phase.name in doc
