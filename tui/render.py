"""Small Rich renderers shared by the panels: bars, sparklines, number formats, request colours."""
from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

from rich.style import Style
from rich.text import Text

# Bar glyphs from empty to full, in eighths of a cell.
EIGHTHS = " ▁▂▃▄▅▆▇█"
HBAR_EIGHTHS = " ▏▎▍▌▋▊▉█"

# Distinct, readable colours for requests on a dark background; picked by a stable hash of the
# request id so a request keeps its colour while others come and go (and snapshots stay fixed).
REQUEST_COLORS = (
    "#5fafff", "#ff875f", "#87d75f", "#d787ff", "#ffd75f", "#5fd7d7", "#ff5f87", "#afaf5f",
    "#87afff", "#ffaf87", "#5fd787", "#ff87d7", "#d7d75f", "#5fafaf", "#d75f5f", "#af87d7",
)
COLOR_FREE = "#3a3a3a"
COLOR_CACHED = "#2e6f6f"
COLOR_LEASED = "#d7af00"     # a prefill server's blocks held for a decode server (KV transfer lease)
COLOR_PREFILL = "#ffaf5f"
COLOR_DECODE = "#5fd787"
COLOR_SEQS = "#87afff"
COLOR_STEP_TIME = "#d7af87"     # a step's measured device time, under the step budget
COLOR_OVER = "#ff5f5f"          # ... and over it
COLOR_DIM = "#6c6c6c"

# What a terminal would act on rather than draw, or what cannot be written to it at all: C0 and C1
# control characters and DEL (escape sequences set the title, blink, clear the screen), the bidi
# overrides and isolates that reorder the text around them, and lone surrogates (not UTF-8).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def spaced(*parts: tuple[str, str]) -> Text:
    """One line from (text, style) parts, with the spaces before each part kept in the part before it."""
    # An exported SVG draws each styled run as one <text> element, and some renderers (librsvg
    # among them) drop a run's leading spaces, which would close a gap that opens a run and undo
    # right alignment. Gaps therefore end the previous run instead; keep backgrounds out of parts.
    text = Text()
    previous = ""
    for chunk, style in parts:
        body = chunk.lstrip(" ")
        text.append(chunk[: len(chunk) - len(body)], style=previous)
        text.append(body, style=style)
        if body:
            previous = style
    return text


def printable(text: str) -> str:
    """Text from a server as it may be drawn: each character a terminal would act on, shown escaped."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode(), text)


def request_color(request_id: str) -> str:
    """The display colour of a request, stable across frames and runs."""
    return REQUEST_COLORS[zlib.crc32(request_id.encode(errors="surrogatepass")) % len(REQUEST_COLORS)]


def hbar(fraction: float | None, width: int, color: str, empty: str = COLOR_FREE) -> Text:
    """A horizontal bar `width` cells wide filled to `fraction` (None: empty), with eighth-cell resolution."""
    width = max(width, 0)
    fraction = min(max(fraction or 0.0, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = Text("█" * full, style=color)
    if full < width:
        # The partial cell is drawn in the bar colour over the empty track colour.
        text.append(HBAR_EIGHTHS[part], style=Style(color=color, bgcolor=empty))
        text.append(" " * (width - full - 1), style=Style(bgcolor=empty))
    return text


def sparkline(values: Sequence[float | None], width: int, vmax: float, color: str) -> Text:
    """One row of the last `width` values as eighth-height bars scaled to [0, vmax]; None is a gap."""
    shown = list(values)[-width:] if width > 0 else []
    chars = []
    for value in shown:
        if value is None:
            chars.append(" ")
            continue
        level = 0 if vmax <= 0 else round(min(max(value / vmax, 0.0), 1.0) * 8)
        # A non-zero value always shows at least the lowest bar.
        if value > 0 and level == 0:
            level = 1
        chars.append(EIGHTHS[level])
    text = Text(" " * (width - len(shown)))
    text.append("".join(chars), style=color)
    return text


# Past this a figure is written with an exponent: a float of 300 digits, cut at a panel's edge,
# would read as an ordinary number.
EXPONENT_FROM = 1e6


def fmt_seconds(value: float | None) -> str:
    """A latency in the unit that keeps three significant figures readable."""
    if value is None:
        return "—"
    if abs(value) < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if abs(value) < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s" if abs(value) < EXPONENT_FROM else f"{value:.0e} s"


def fmt_bytes(value: int) -> str:
    """Bytes in binary units."""
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(amount) < 1024 or unit == "EiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} EiB"


def fmt_rate(value: float) -> str:
    """A token rate, compact above ten thousand."""
    if abs(value) >= 10_000:
        kilo = value / 1000
        return f"{kilo:.1f}k" if abs(kilo) < EXPONENT_FROM else f"{kilo:.0e}k"
    return f"{value:.1f}"


def fmt_percent(fraction: float | None, decimals: int = 1) -> str:
    """A fraction in [0, 1] as a percentage; None (not reported) as a dash."""
    if fraction is None:
        return "—"
    percent = fraction * 100
    return f"{percent:.{decimals}f}%" if abs(percent) < EXPONENT_FROM else f"{percent:.0e}%"


def fmt_number(value: float, decimals: int = 2) -> str:
    """A figure with `decimals` places, or with an exponent past EXPONENT_FROM."""
    return f"{value:.{decimals}f}" if abs(value) < EXPONENT_FROM else f"{value:.0e}"
