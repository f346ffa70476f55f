"""Render a `tmux capture-pane -p -e` capture (SGR colours) to a PNG: ansi_to_png.py IN.txt OUT.png.

Needs Pillow (not a fimble dependency: `pip install pillow` wherever you run this) and a monospace
TrueType font (DejaVu Sans Mono by default, `--font` to change).
"""

from __future__ import annotations

import argparse
import re

from PIL import Image, ImageDraw, ImageFont

BASIC = ["#1e1e1e", "#cd3131", "#0dbc79", "#e5e510", "#2472c8", "#bc3fbc", "#11a8cd", "#e5e5e5",
         "#666666", "#f14c4c", "#23d18b", "#f5f543", "#3b8eea", "#d670d6", "#29b8db", "#ffffff"]
FG, BG = "#d4d4d4", "#1e1e1e"
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def xterm256(n: int) -> str:
    if n < 16:
        return BASIC[n]
    if n < 232:
        n -= 16
        levels = [0, 95, 135, 175, 215, 255]
        r, g, b = levels[n // 36], levels[(n // 6) % 6], levels[n % 6]
        return f"#{r:02x}{g:02x}{b:02x}"
    g = 8 + (n - 232) * 10
    return f"#{g:02x}{g:02x}{g:02x}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--font", default="/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf")
    ap.add_argument("--size", type=int, default=16)
    args = ap.parse_args()
    # (bold, italic) -> font; DejaVu names its italics "Oblique" (the ghost text is italic)
    variants = {(False, False): "", (True, False): "-Bold", (False, True): "-Oblique", (True, True): "-BoldOblique"}
    fonts = {k: ImageFont.truetype(args.font.replace(".ttf", v + ".ttf"), args.size) for k, v in variants.items()}
    cw = int(fonts[False, False].getlength("M"))
    ch = int(args.size * 1.35)
    lines = open(args.src, encoding="utf-8").read().rstrip("\n").split("\n")
    cols = max(len(SGR.sub("", x)) for x in lines)
    img = Image.new("RGB", (cw * max(cols, 90) + 20, ch * len(lines) + 20), BG)
    draw = ImageDraw.Draw(img)
    fg, bg, bold, reverse, italic = FG, None, False, False, False  # SGR state carries across lines, as captured
    for row, line in enumerate(lines):
        col, pos = 0, 0
        for m in [*SGR.finditer(line), None]:
            text = line[pos:m.start() if m else len(line)]
            for c in text:
                f, b = (bg or BG, fg) if reverse else (fg, bg)
                x, y = 10 + col * cw, 10 + row * ch
                if b:
                    draw.rectangle([x, y, x + cw, y + ch], fill=b)
                draw.text((x, y), c, font=fonts[bold, italic], fill=f)
                col += 1
            if m is None:
                break
            pos = m.end()
            codes = [int(c) if c else 0 for c in m.group(1).split(";")]
            i = 0
            while i < len(codes):
                c = codes[i]
                if c == 0:
                    fg, bg, bold, reverse, italic = FG, None, False, False, False
                elif c == 1:
                    bold = True
                elif c == 3:
                    italic = True
                elif c == 23:
                    italic = False
                elif c == 7:
                    reverse = True
                elif c == 22:
                    bold = False
                elif c == 27:
                    reverse = False
                elif 30 <= c <= 37 or 90 <= c <= 97:
                    fg = BASIC[c - 30 if c < 90 else c - 82]
                elif c == 39:
                    fg = FG
                elif 40 <= c <= 47 or 100 <= c <= 107:
                    bg = BASIC[c - 40 if c < 100 else c - 92]
                elif c == 49:
                    bg = None
                elif c in (38, 48) and i + 2 < len(codes) and codes[i + 1] == 5:
                    if c == 38:
                        fg = xterm256(codes[i + 2])
                    else:
                        bg = xterm256(codes[i + 2])
                    i += 2
                i += 1
        if reverse or bg:  # a status line: fill to the right edge
            x = 10 + col * cw
            draw.rectangle([x, 10 + row * ch, img.width - 10, 10 + (row + 1) * ch], fill=(fg if reverse else bg))
    img.save(args.dst)


if __name__ == "__main__":
    main()
