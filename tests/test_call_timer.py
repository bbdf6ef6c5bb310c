"""The benchmarks' call timer (benchmarks/oaken_call_timer.py) counts each outermost call of a label once: an
override that falls back on its wrapped base is not timed twice."""

from benchmarks.oaken_call_timer import CallTimer


class Base:
    def read(self) -> str:
        return "base"


class Override(Base):
    def read(self) -> str:
        return "override" if self.whole else super().read()

    whole = True


def test_an_override_falling_back_on_its_base_is_counted_once():
    calls = {"read": [(__name__, "Base.read"), (__name__, "Override.read")]}
    with CallTimer(calls) as timer:
        reader = Override()
        assert reader.read() == "override"
        reader.whole = False
        assert reader.read() == "base"
        assert Base().read() == "base"
    assert timer.counts["read"] == 3
    assert Override.read is not Base.read and Base.read.__name__ == "read"  # restored
    assert "timed" not in repr(Base.read)
