"""macOS energy from IOReport's "Energy Model" group, through ctypes (no sudo).

libIOReport is a private library in the dyld shared cache: load it by its absolute path. Every
pointer-returning function gets `restype = c_void_p` (the default int would truncate pointers),
and plain `CDLL` releases the GIL during calls. Samples are cumulative; the difference of two
(`IOReportCreateSamplesDelta`) holds each channel's energy over the window, in the unit its label
names. Channels are matched exactly or by anchored patterns: substring matching counts the
per-cluster and per-core channels again (CPU rail) or the GPU twice.
"""

from __future__ import annotations

import ctypes
import re

from .meter import MeterUnavailable

_CF_PATH = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
_IOREPORT_PATH = "/usr/lib/libIOReport.dylib"
_UTF8 = 0x08000100
_INT64_MIN = -(2**63)

# Rail -> channel names that make it up. Ultra chips have no package CPU channel, only one per
# die ("DIE_0_CPU Energy"); "GPU Energy" alone is the GPU (GPU0/GPU0_0 duplicate it).
_RAILS = {
    "cpu": re.compile(r"^(DIE_\d+_)?CPU Energy$"),
    "gpu": re.compile(r"^GPU Energy$"),
    "ane": re.compile(r"^ANE\d*(_\d+)?$"),
    "dram": re.compile(r"^DRAM\d*(_\d+)?$"),
}
_JOULES_PER_UNIT = {"J": 1.0, "kJ": 1e3, "cJ": 1e-2, "mJ": 1e-3, "uJ": 1e-6, "µJ": 1e-6,
                    "nJ": 1e-9, "pJ": 1e-12}


def rail_of(channel: str) -> str | None:
    for rail, pattern in _RAILS.items():
        if pattern.match(channel):
            return rail
    return None


def _libraries():
    try:
        cf = ctypes.CDLL(_CF_PATH)
        ior = ctypes.CDLL(_IOREPORT_PATH)
    except OSError as e:
        raise MeterUnavailable(f"cannot load IOReport ({e})") from e
    vp, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    for name, res, args in (
        ("CFStringCreateWithCString", vp, [vp, ctypes.c_char_p, ctypes.c_uint32]),
        ("CFStringGetCString", ctypes.c_bool, [vp, ctypes.c_char_p, ctypes.c_long,
                                               ctypes.c_uint32]),
        ("CFDictionaryGetValue", vp, [vp, vp]),
        ("CFArrayGetCount", ctypes.c_long, [vp]),
        ("CFArrayGetValueAtIndex", vp, [vp, ctypes.c_long]),
        ("CFRelease", None, [vp]),
    ):
        fn = getattr(cf, name)
        fn.restype, fn.argtypes = res, args
    for name, res, args in (
        ("IOReportCopyChannelsInGroup", vp, [vp, vp, u64, u64, u64]),
        ("IOReportCreateSubscription", vp, [vp, vp, ctypes.POINTER(vp), u64, vp]),
        ("IOReportCreateSamples", vp, [vp, vp, vp]),
        ("IOReportCreateSamplesDelta", vp, [vp, vp, vp]),
        ("IOReportChannelGetChannelName", vp, [vp]),
        ("IOReportChannelGetUnitLabel", vp, [vp]),
        ("IOReportSimpleGetIntegerValue", i64, [vp, ctypes.c_int32]),
    ):
        fn = getattr(ior, name)
        fn.restype, fn.argtypes = res, args
    return cf, ior


class IOReportMeter:
    backend = "ioreport"

    def __init__(self):
        self.cf, self.ior = _libraries()
        self._keep: list[int] = []  # CF objects released on close
        group = self._cfstr("Energy Model")
        self.channels = self.ior.IOReportCopyChannelsInGroup(group, None, 0, 0, 0)
        if not self.channels:
            self.close()
            raise MeterUnavailable("IOReport has no 'Energy Model' channel group here")
        self._keep.append(self.channels)
        subscribed = ctypes.c_void_p()
        self.subscription = self.ior.IOReportCreateSubscription(
            None, self.channels, ctypes.byref(subscribed), 0, None)
        if not self.subscription:
            self.close()
            raise MeterUnavailable("IOReportCreateSubscription failed")
        self._keep += [self.subscription] + ([subscribed.value] if subscribed.value else [])
        self.first = self._sample()
        self._keep.append(self.first)
        if not self.read():
            self.close()
            raise MeterUnavailable("no CPU, GPU, ANE or DRAM energy channel in 'Energy Model'")

    def _cfstr(self, text: str) -> int:
        ref = self.cf.CFStringCreateWithCString(None, text.encode(), _UTF8)
        self._keep.append(ref)
        return ref

    def _str(self, ref) -> str:
        if not ref:
            return ""
        buf = ctypes.create_string_buffer(256)
        ok = self.cf.CFStringGetCString(ref, buf, len(buf), _UTF8)
        return buf.value.decode("utf-8", "replace") if ok else ""

    def _sample(self) -> int:
        sample = self.ior.IOReportCreateSamples(self.subscription, self.channels, None)
        if not sample:
            raise MeterUnavailable("IOReportCreateSamples failed")
        return sample

    def read(self) -> dict[str, float]:
        now = self._sample()
        delta = self.ior.IOReportCreateSamplesDelta(self.first, now, None)
        try:
            return self._joules(delta) if delta else {}
        finally:
            for ref in filter(None, (delta, now)):
                self.cf.CFRelease(ref)

    def _joules(self, delta) -> dict[str, float]:
        key = self.cf.CFStringCreateWithCString(None, b"IOReportChannels", _UTF8)
        try:
            items = self.cf.CFDictionaryGetValue(delta, key)
        finally:
            self.cf.CFRelease(key)
        out: dict[str, float] = {}
        for i in range(self.cf.CFArrayGetCount(items) if items else 0):
            item = self.cf.CFArrayGetValueAtIndex(items, i)
            rail = rail_of(self._str(self.ior.IOReportChannelGetChannelName(item)))
            unit = self._str(self.ior.IOReportChannelGetUnitLabel(item)).strip()
            value = self.ior.IOReportSimpleGetIntegerValue(item, 0)
            if rail is None or unit not in _JOULES_PER_UNIT or value == _INT64_MIN:
                continue
            out[rail] = out.get(rail, 0.0) + value * _JOULES_PER_UNIT[unit]
        return out

    def close(self) -> None:
        while self._keep:
            self.cf.CFRelease(self._keep.pop())
