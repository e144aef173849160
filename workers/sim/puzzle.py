"""The sliding puzzle the scripted policy plays (`--puzzle`, NeMo-RL's SlidingPuzzleEnv games):
the next move of a shortest solution of the last board drawn in the context."""

from __future__ import annotations

import re

_BOARD_ROW = re.compile(r"^(\d+) \|(.*)\|$")
_ACTION = re.compile(r"<action>\s*(.*?)\s*</action>", re.S)
# a move names the direction the tile next to the gap slides: (row, col) of that tile from the gap
_SLIDES = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}


def puzzle_move(context: str) -> str:
    """The next move of a shortest solution of the sliding puzzle in `context`: its last drawn
    board (rows `1 | 1  2  3 |`, 0 = the gap), with every `<action>move</action>` written after
    the board applied; `view` when no board is drawn (or it is solved or unsolvable here)."""
    board: list[list[int]] = []
    end = pos = 0
    rows: list[str] = []
    for line in context.split("\n"):
        pos += len(line) + 1
        m = _BOARD_ROW.match(line)
        if m and int(m.group(1)) == len(rows) + 1:
            rows.append(m.group(2))
            parsed = _parse_board(rows)
            if parsed is not None:
                board, end = parsed, pos
        else:
            rows = [m.group(2)] if m and m.group(1) == "1" else []
    if not board:
        return "view"
    for action in _ACTION.findall(context[end:]):
        board = _slide(board, action.strip().lower()) or board
    size = len(board)
    goal = tuple(list(range(1, size * size)) + [0])
    start = tuple(v for row in board for v in row)
    seen, frontier = {start: ""}, [start]
    while frontier and goal not in seen and len(seen) < 200_000:
        nxt = []
        for state in frontier:
            grid = [list(state[r * size : (r + 1) * size]) for r in range(size)]
            for move in _SLIDES:
                after = _slide(grid, move)
                key = tuple(v for row in after for v in row) if after else None
                if key is not None and key not in seen:
                    seen[key] = seen[state] + " " + move if seen[state] else move
                    nxt.append(key)
        frontier = nxt
    path = seen.get(goal, "")
    return path.split()[0] if path else "view"


def _parse_board(rows: list[str]) -> list[list[int]] | None:
    """The rows drawn so far as a board when they make a whole one (each tile once, one gap)."""
    n = len(rows)
    if n < 2 or any(len(r) != len(rows[0]) for r in rows) or len(rows[0]) % n:
        return None
    width = len(rows[0]) // n
    cells = [r[c * width : (c + 1) * width].strip() for r in rows for c in range(n)]
    if not all(v == "" or v.isdigit() for v in cells):
        return None
    values = [int(v) if v else 0 for v in cells]
    if sorted(values) != list(range(n * n)):
        return None
    return [values[r * n : (r + 1) * n] for r in range(n)]


def _slide(board: list[list[int]], move: str) -> list[list[int]] | None:
    """The board after `move` (the tile beside the gap slides into it), None if it cannot."""
    if move not in _SLIDES:
        return None
    size = len(board)
    gr, gc = next((r, c) for r in range(size) for c in range(size) if board[r][c] == 0)
    tr, tc = gr + _SLIDES[move][0], gc + _SLIDES[move][1]
    if not (0 <= tr < size and 0 <= tc < size):
        return None
    after = [row[:] for row in board]
    after[gr][gc], after[tr][tc] = after[tr][tc], 0
    return after
