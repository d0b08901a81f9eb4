"""Argument checks for the public entry points: hyperrec's validation dialect.

Each helper names the argument as the caller spelled it and returns the checked value.
A wrong type raises ``TypeError``, a wrong value ``ValueError``; messages read
``"<name> must be <expectation>, got <what>"``. Every hyperrec package carries the same
helpers in its private ``_validate.py`` (a runtime package never imports the dev-only
``hyperrec.testing``); ``nox -s lint`` checks that the copies are identical, so copy
them from here into a new package and add package-specific checks below them.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Collection
from typing import Any, cast

import torch

__all__ = ["check_bool", "check_choice", "check_float", "check_int", "check_tensor"]


def _what(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (numpy integers accepted; bools and floats, even ``2.0``,
    are not). A ``torch.SymInt`` (under ``torch.compile``) or an ``int`` is returned as
    it is.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value < minimum``.
    """
    if isinstance(value, torch.SymInt):
        out = cast(int, value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_what(value)}")
    elif isinstance(value, int):
        # A plain int passes through: while Dynamo traces, a dynamic int reports itself as
        # an int (not a SymInt), and operator.index would specialise the graph on it.
        out = value
    else:
        out = operator.index(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    exclusive: bool = False,
    finite: bool = True,
) -> float:
    """``value`` (any real number but a bool) as a Python float; a ``torch.SymFloat`` or a
    ``float`` is returned as it is. ``minimum`` is inclusive unless ``exclusive``
    (``> minimum``).

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: NaN or infinite (with ``finite``), or below ``minimum``.
    """
    if isinstance(value, torch.SymFloat | torch.SymInt):
        out = cast(float, value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_what(value)}")
    elif isinstance(value, float):
        out = value  # passes through, as in check_int
    else:
        out = float(value)
    # Comparisons rather than math.isfinite: they also trace symbolic floats.
    if finite and not -float("inf") < out < float("inf"):
        raise ValueError(f"{name} must be finite, got {out}")
    if minimum is not None:
        if exclusive and not out > minimum:
            raise ValueError(f"{name} must be > {minimum}, got {out}")
        if not exclusive and not out >= minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (ints, even 0 and 1, are not).

    Raises:
        TypeError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_what(value)}")
    return value


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices`` (strings for modes, or e.g. ints for sizes).

    Raises:
        TypeError: ``value`` is not of the choices' type (a bool is never an int here).
        ValueError: another value of that type.
    """
    options = tuple(choices)
    kinds = tuple({type(c) for c in options})
    if isinstance(value, bool) != any(isinstance(c, bool) for c in options) or not isinstance(
        value, kinds
    ):
        raise TypeError(f"{name} must be one of {options}, got {_what(value)}")
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def check_tensor(
    name: str,
    t: Any,
    *,
    dtypes: Collection[torch.dtype] | None = None,
    ndim: int | Collection[int] | None = None,
) -> torch.Tensor:
    """``t`` if it is a tensor of one of ``dtypes`` with ``ndim`` dims (an int or a set).

    Raises:
        TypeError: ``t`` is not a tensor, or has another dtype.
        ValueError: another number of dims.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        want = " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))
        got = str(t.dtype).removeprefix("torch.")
        article = "an" if want[0] in "aeiou" else "a"
        raise TypeError(f"{name} must be {article} {want} tensor, got {got}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in dims:
            want = " or ".join(f"{d}-D" for d in dims)
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t


# ----------------------------------------------------------------------------------------
# jagged_attn: the attention inputs, and the checks on offset values
# ----------------------------------------------------------------------------------------
#
# Shape, dtype and device checks read metadata only and always run. Checks on the *values*
# of the offsets, maxima, ``kv_index`` and ``num_targets`` need those values; where they run
# is chosen by ``value_check_mode`` from the ``validate`` argument and the device:
#
# * ``"host"``: read the values on the host (one batched transfer) and raise ValueErrors
#   naming the argument. Free on CPU tensors (no device to wait for), so the default there;
#   on CUDA only with ``validate="full"`` (it waits for the GPU: a host sync per call).
# * ``"device"``: the default on CUDA. The same conditions, reduced on the GPU to one flag
#   and checked by ``torch._assert_async``: no host sync. For the Triton forward on a new
#   offsets object the flag comes from its tile-schedule kernel (``_triton/_tiles.py``), so
#   the check adds only the assert; otherwise one Triton kernel computes it
#   (``_triton/_checks.py``; PyTorch ops where Triton cannot run). Either only for offsets
#   the call has not seen before (results are cached per tensor
#   object and version, like the kernels' schedules). A violation is a device-side assert:
#   the CUDA error surfaces at the next synchronisation and leaves the CUDA context
#   unusable, as any device-side assert does (re-run with ``validate="full"`` for the
#   ValueError).
# * ``"none"``: ``validate=False``, and inside ``torch.compile`` tracing (the graph carries
#   the custom op; the checks would break it).

import threading  # noqa: E402
import weakref  # noqa: E402
from collections import OrderedDict  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Literal  # noqa: E402

__all__ += [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "VALIDATE_CHOICES",
    "CheckMode",
    "DeviceCheck",
    "Names",
    "Validate",
    "check_index_tensor",
    "check_qkv",
    "check_validate",
    "run_value_checks",
    "set_pending_check",
    "take_pending_check",
    "value_check_mode",
]

#: Accepted dtypes of q, k and v.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Accepted dtypes of offsets, ``kv_index`` and ``num_targets``.
INDEX_DTYPES = (torch.int32, torch.int64)
#: Accepted values of ``validate=``.
VALIDATE_CHOICES: tuple[bool | str, ...] = (True, False, "full")

Validate = bool | Literal["full"]
CheckMode = Literal["none", "host", "device"]


@dataclass(frozen=True)
class Names:
    """How the caller spelled each argument, for error messages."""

    q_offsets: str = "q_offsets"
    kv_offsets: str = "kv_offsets"
    max_seqlen_q: str = "max_seqlen_q"
    max_seqlen_kv: str = "max_seqlen_kv"


def _dense(name: str, t: Any, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    check_tensor(name, t, dtypes=dtypes)
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def check_qkv(q: Any, k: Any, v: Any) -> None:
    """``q (Tq, H, D)``, ``k (Tk, H, D)``, ``v (Tk, H, Dv)``: one float dtype, one device.

    Raises:
        TypeError: a non-tensor, a sparse/nested tensor, an unsupported or mixed dtype.
        ValueError: wrong ranks, mismatched heads/head dims/token counts, several devices.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _dense(name, t, FLOAT_DTYPES)
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    heads, dim = q.shape[1], q.shape[2]
    if heads < 1 or dim < 1:
        raise ValueError(f"q must have heads >= 1 and head_dim >= 1, got shape {tuple(q.shape)}")
    if k.shape[1] != heads or v.shape[1] != heads:
        raise ValueError(
            f"q, k and v must have the same number of heads, got {heads}, {k.shape[1]}, "
            f"{v.shape[1]}"
        )
    if k.shape[2] != dim:
        raise ValueError(f"k head_dim must equal q head_dim {dim}, got {k.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(
            f"v.shape[0] must equal k.shape[0] (total key tokens) {k.shape[0]}, got {v.shape[0]}"
        )
    if v.shape[2] < 1:
        raise ValueError(f"v head_dim must be >= 1, got shape {tuple(v.shape)}")


def check_index_tensor(
    name: str,
    t: Any,
    device: torch.device,
    *,
    length: int | None = None,
    what: str,
    like: str = "q",
) -> torch.Tensor:
    """A 1-D int32/int64 tensor on ``device`` (that of the tensor named ``like``):
    ``length`` entries, or >= 1 if None.

    Raises:
        TypeError: not a dense tensor, or not int32/int64.
        ValueError: not 1-D, the wrong number of entries, another device.
    """
    t = _dense(name, t, INDEX_DTYPES)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D {what}, got shape {tuple(t.shape)}")
    if length is None and t.numel() < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries {what}, got none")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries {what}, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like {like}, got {t.device}")
    return t


def check_validate(value: Any) -> Validate:
    """``value`` if it is ``True``, ``False`` or ``"full"``.

    Raises:
        TypeError: neither a bool nor a str.
        ValueError: another string.
    """
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"validate must be True, False or 'full', got {_what(value)}")
    if value != "full":
        raise ValueError(f"validate must be True, False or 'full', got {value!r}")
    return "full"


def value_check_mode(validate: Validate, device: torch.device) -> CheckMode:
    """Where the value checks of a call run (see the comment above): ``"none"`` for
    ``validate=False`` or while ``torch.compile`` traces; ``"host"`` for
    ``validate="full"`` and for CPU tensors; ``"device"`` for ``validate=True`` on any
    other device (``"none"`` on ``meta``, which holds no values)."""
    if validate is False or torch.compiler.is_compiling():
        return "none"
    if validate == "full" or device.type == "cpu":
        return "host"
    return "none" if device.type == "meta" else "device"


def _offsets_summary(offsets: torch.Tensor) -> list[torch.Tensor]:
    o = offsets.long()
    lengths = o[1:] - o[:-1]
    if lengths.numel() == 0:
        zero = o.new_zeros(())
        return [o[0], o[-1], zero, zero]
    return [o[0], o[-1], (lengths < 0).any().long(), lengths.max()]


def _check_offsets(name: str, values: list[int], total: int, total_name: str) -> None:
    first, last, unordered, _ = values
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if unordered:
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0)")
    if last != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}, got {last}")


def _host_checks(
    total_q: int,
    total_k: int,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    names: Names,
) -> None:
    parts = _offsets_summary(q_offsets) + _offsets_summary(kv_offsets)
    k_len = (kv_offsets[1:] - kv_offsets[:-1]).long()
    num_kv = k_len.numel()
    if kv_index is not None:
        if kv_index.numel():
            parts += [kv_index.min().long(), kv_index.max().long()]
        else:
            parts += [q_offsets.new_zeros((), dtype=torch.long)] * 2
        if num_kv:
            k_len = k_len[kv_index.long().clamp(0, num_kv - 1)]
    if num_targets is not None:
        if num_targets.numel() and num_kv:
            parts += [num_targets.min().long(), (num_targets.long() > k_len).any().long()]
        else:
            parts += [q_offsets.new_zeros((), dtype=torch.long)] * 2
    values = torch.stack([p.to(q_offsets.device) for p in parts]).tolist()

    _check_offsets(names.q_offsets, values[0:4], total_q, "q.shape[0] (total query tokens)")
    if names.kv_offsets != names.q_offsets:
        _check_offsets(names.kv_offsets, values[4:8], total_k, "k.shape[0] (total key tokens)")
    if values[3] > max_seqlen_q:
        raise ValueError(
            f"{names.max_seqlen_q}={max_seqlen_q} is smaller than the longest query "
            f"sequence ({values[3]})"
        )
    if values[7] > max_seqlen_kv:
        raise ValueError(
            f"{names.max_seqlen_kv}={max_seqlen_kv} is smaller than the longest key "
            f"sequence ({values[7]})"
        )
    rest = values[8:]
    if kv_index is not None:
        lo, hi = rest[:2]
        rest = rest[2:]
        if kv_index.numel() and (lo < 0 or hi >= num_kv):
            raise ValueError(
                f"kv_index entries must lie in [0, {num_kv}) (the number of kv sequences), "
                f"got range [{lo}, {hi}]"
            )
    if num_targets is not None:
        lo, too_many = rest[:2]
        if lo < 0:
            raise ValueError(f"num_targets must be >= 0, got a minimum of {lo}")
        if too_many:
            raise ValueError("num_targets must not exceed the length of its kv sequence")


def _offsets_ok(offsets: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """A 0-dim bool tensor on the offsets' device: the host checks' conditions."""
    ok = (offsets[0] == 0) & (offsets[-1] == total)
    if offsets.numel() > 1:
        lo, hi = torch.aminmax(offsets[1:] - offsets[:-1])
        ok = ok & (lo >= 0) & (hi <= max_len)
    return ok


def _device_condition(
    total_q: int,
    total_k: int,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
) -> torch.Tensor:
    """Every value check as one 0-dim bool tensor, computed without reading a value."""
    ok = _offsets_ok(q_offsets, total_q, max_seqlen_q)
    same = kv_offsets is q_offsets and total_k == total_q and max_seqlen_kv >= max_seqlen_q
    if not same:  # self-attention checks one offsets tensor once
        ok = ok & _offsets_ok(kv_offsets, total_k, max_seqlen_kv)
    k_len = kv_offsets[1:] - kv_offsets[:-1]
    num_kv = k_len.numel()
    if kv_index is not None and kv_index.numel():
        lo, hi = torch.aminmax(kv_index)
        ok = ok & (lo >= 0) & (hi < num_kv)
        if num_kv:
            k_len = k_len[kv_index.clamp(0, num_kv - 1)]
    if num_targets is not None and num_targets.numel() and num_kv:
        ok = ok & (num_targets >= 0).all() & (num_targets <= k_len).all()
    return ok


def _fused_condition(*args: Any) -> torch.Tensor:
    """:func:`_device_condition` from one Triton kernel where the Triton kernels run (a
    dozen PyTorch dispatches cost more host time than a short attention call), else from
    PyTorch ops. Nonzero means valid."""
    offsets = args[2]
    if offsets.device.type == "cuda":
        from hyperrec.jagged_attn._triton import interpreting, supports

        if supports(offsets.device) and not interpreting():
            from hyperrec.jagged_attn._triton._checks import values_ok

            return values_ok(*args)
    return _device_condition(*args)


def _assert_async(cond: torch.Tensor, message: str) -> None:
    try:
        torch._assert_async(cond, message)
    except TypeError:  # torch without the message overload
        torch._assert_async(cond)


# Offsets already checked on the device, keyed by the index tensors' identities and the
# scalars they were checked against; weak references and version counters make sure a
# freed or modified tensor is checked again.
_CHECKED_SIZE = 64
# (ids of the tensors, scalars) -> (weak references to the tensors, their versions)
_CheckKey = tuple[tuple[int, ...], tuple[int, ...]]
_CheckEntry = tuple[tuple[weakref.ref[torch.Tensor] | None, ...], tuple[int, ...]]
_checked: OrderedDict[_CheckKey, _CheckEntry] = OrderedDict()


def _versions(tensors: tuple[torch.Tensor | None, ...]) -> tuple[int, ...] | None:
    try:
        return tuple([-1 if t is None else t._version for t in tensors])
    except RuntimeError:  # inference tensors carry no version counter: never cached
        return None


def _alive(refs: tuple[weakref.ref[torch.Tensor] | None, ...],
           tensors: tuple[torch.Tensor | None, ...]) -> bool:  # fmt: skip
    for r, t in zip(refs, tensors):
        if r is None:
            if t is not None:
                return False
        elif r() is not t:
            return False
    return True


# The entry of the latest hit or insert: a model's layers call with one batch's offsets
# one after the other, so most lookups match it without building the dictionary key.
_last: list[tuple[Any, ...] | None] = [None]


def _already_checked(tensors: tuple[torch.Tensor | None, ...], scalars: tuple[int, ...]) -> bool:
    versions = _versions(tensors)
    if versions is None:
        return False
    last = _last[0]
    if last is not None and last[1] == versions and last[2] == scalars and _alive(last[0], tensors):
        return True
    key = (tuple(id(t) for t in tensors), scalars)
    hit = _checked.get(key)
    if hit is not None:
        refs, old = hit
        if old == versions and _alive(refs, tensors):
            _checked.move_to_end(key)
            _last[0] = (refs, versions, scalars)
            return True
    refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
    _checked[key] = (refs, versions)
    _last[0] = (refs, versions, scalars)
    while len(_checked) > _CHECKED_SIZE:
        _checked.popitem(last=False)
    return False


class DeviceCheck:
    """A ``"device"``-mode value check that has not run yet (see :func:`run_value_checks`
    with ``defer=True``): ``args`` is the argument tuple of ``_checks.values_ok``."""

    __slots__ = ("args", "names")

    def __init__(self, args: tuple[Any, ...], names: Names) -> None:
        self.args, self.names = args, names

    @property
    def message(self) -> str:
        """The device assert's message (built only when a host-side assert needs it)."""
        n = self.names
        return (
            f"hyperrec.jagged_attn: invalid {n.q_offsets}, {n.kv_offsets}, "
            f"{n.max_seqlen_q}, {n.max_seqlen_kv}, kv_index or num_targets values "
            "(call with validate='full' for the error that names the argument)"
        )

    def run(self) -> None:
        """Compute the flag (its own launch) and assert it on the device."""
        _assert_async(_fused_condition(*self.args), self.message)

    def assert_flag(self, ok: torch.Tensor) -> None:
        """Assert a flag computed elsewhere (the tile-schedule kernel) from :attr:`args`."""
        _assert_async(ok, self.message)

    def asserted_in_kernel(self) -> None:
        """The tile-schedule kernel asserted the check itself (``tl.device_assert``):
        nothing left to launch (a hook for tests and counters)."""


# The deferred check of the call in progress on this thread: set by the public layer
# around the Triton op, taken by the forward launcher (``take_pending_check``), which
# fuses it into the schedule build of a new offsets object or runs it before its kernel.
_pending = threading.local()


def set_pending_check(check: DeviceCheck | None) -> DeviceCheck | None:
    """Make ``check`` the pending check of this thread; returns the one it replaces."""
    old = getattr(_pending, "check", None)
    _pending.check = check
    return old


def take_pending_check() -> DeviceCheck | None:
    """The pending check of this thread (now no longer pending), or None."""
    check = getattr(_pending, "check", None)
    if check is not None:
        _pending.check = None
    return check


def run_value_checks(
    mode: CheckMode,
    q: torch.Tensor,
    k: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    names: Names,
    defer: bool = False,
) -> DeviceCheck | None:
    """The value checks in ``mode`` (see :func:`value_check_mode`).

    ``defer=True`` (``"device"`` mode): instead of launching the check, return it as a
    :class:`DeviceCheck` for the caller to fuse into its own first kernel or run before
    it; None when there is nothing to check (other modes, or offsets already checked).

    Raises:
        ValueError: (``"host"`` mode) an offsets tensor does not start at 0, decreases, or
            does not end at its token count; a sequence is longer than its ``max_seqlen``;
            ``kv_index`` points outside ``[0, Bk)``; ``num_targets`` is negative or exceeds
            the length of its kv sequence. In ``"device"`` mode the same conditions raise
            a device-side assert instead (asynchronously, at a later synchronisation).
    """
    if mode == "none":
        return None
    args = (q.shape[0], k.shape[0], q_offsets, kv_offsets, max_seqlen_q, max_seqlen_kv,
            kv_index, num_targets)  # fmt: skip
    if mode == "host":
        _host_checks(*args, names)
    elif mode == "device":
        if _already_checked((q_offsets, kv_offsets, kv_index, num_targets),
                            (args[0], args[1], max_seqlen_q, max_seqlen_kv)):  # fmt: skip
            return None
        check = DeviceCheck(args, names)
        if defer:
            return check
        check.run()
    return None
