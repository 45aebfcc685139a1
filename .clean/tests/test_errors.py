"""bcg.errors.first_line: an exception quoted in one line keeps the line that says what happened."""

from __future__ import annotations

from bcg.errors import first_line


def test_a_lead_in_line_is_skipped_for_the_line_that_says_what_happened() -> None:
    from torch._dynamo.exc import BackendCompilerFailed

    class Compiler:  # dynamo names the backend by its __name__, here a repr with an address in it
        __name__ = "PiecewiseCompiler(pool=<GraphPool object at 0x7f00deadbeef>)"

    e = BackendCompilerFailed(Compiler(), RuntimeError("GLOBAL_STATE changed: num_threads"), None)
    line = first_line(e)
    assert line == "BackendCompilerFailed: RuntimeError: GLOBAL_STATE changed: num_threads", line
    assert "0x7f00deadbeef" not in line


def test_a_message_of_lead_ins_only_is_quoted_by_its_first_line() -> None:
    assert first_line(ValueError("\n  the pieces were:\n  and then:\n")) == "ValueError: the pieces were:"


def test_an_ordinary_message_keeps_its_first_line() -> None:
    assert first_line(OSError("cannot write out/x: disk full\nerrno 28")) == "OSError: cannot write out/x: disk full"
