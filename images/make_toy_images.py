"""Draw the example subject in images/toy/: a small orange toy robot, five views.

The pictures are made here (no photos copied from anywhere); rerun to recreate them.
"""

import os

from PIL import Image
from PIL import ImageDraw

HERE = os.path.dirname(os.path.abspath(__file__))
VIEWS = [  # (background, centre x, centre y, scale)
    ((120, 170, 220), 0.50, 0.55, 1.00),
    ((90, 160, 90), 0.40, 0.60, 0.80),
    ((230, 220, 200), 0.60, 0.50, 1.15),
    ((60, 60, 80), 0.50, 0.45, 0.90),
    ((200, 120, 140), 0.45, 0.55, 1.05),
]


def draw_robot(draw, cx, cy, s):
    body = (255, 140, 30)
    draw.rectangle([cx - 60 * s, cy - 20 * s, cx + 60 * s, cy + 90 * s], fill=body, outline="black", width=3)
    draw.rectangle([cx - 45 * s, cy - 100 * s, cx + 45 * s, cy - 25 * s], fill=body, outline="black", width=3)
    for dx in (-20, 20):
        draw.ellipse([cx + (dx - 10) * s, cy - 80 * s, cx + (dx + 10) * s, cy - 60 * s], fill="white", outline="black")
        draw.ellipse([cx + (dx - 4) * s, cy - 74 * s, cx + (dx + 4) * s, cy - 66 * s], fill="black")
    draw.line([cx, cy - 100 * s, cx, cy - 125 * s], fill="black", width=3)
    draw.ellipse([cx - 8 * s, cy - 135 * s, cx + 8 * s, cy - 119 * s], fill=(220, 30, 30))
    draw.rectangle([cx - 25 * s, cy + 10 * s, cx + 25 * s, cy + 40 * s], fill=(40, 90, 200))


def main():
    for k, (background, x, y, scale) in enumerate(VIEWS):
        image = Image.new("RGB", (256, 256), background)
        draw = ImageDraw.Draw(image)
        draw.rectangle([0, 200, 256, 256], fill=tuple(c // 2 for c in background))
        draw_robot(draw, 256 * x, 256 * y, scale)
        image.save(os.path.join(HERE, "toy", f"toy-{k}.jpg"), quality=92)


if __name__ == "__main__":
    main()
