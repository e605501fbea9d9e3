"""`shapes`: a generated picture-counting task for the shipped tiny vision-language model (backstream/tiny_vlm.py).

A row is a 56 × 56 picture of 1 to 6 filled squares and circles in red, green and blue on white,
and a question naming one colour, "red?"; the answer is how many shapes have that colour, 0 to 4
(the colour may be absent). The text is short because the tiny VLM's tokenizer is character level;
its chat template renders the row as `<|vision_start|><|image_pad|>…<|vision_end|>red?=` and the
model answers "2<eos>".

Why a tiny model can learn it: the picture is a 4 × 4 grid of 14-pixel cells with at most one shape
per cell (10 to 12 px, jittered inside it, so no two overlap or touch), and the tiny VLM's tower reads
7-px patches merged 2 × 2: one image token per cell, which shows one colour or none. The answer is
then a count over the 16 tokens of those with the asked colour, which attention does as an average.
Only the count is asked, never a shape's kind or place.

Everything comes from the `random.Random` passed in (PIL draws without randomness of its own), so a
seed gives the same rows, pixel for pixel, on any machine.
"""

from __future__ import annotations

import random

SIZE = 56  # pixels; the tiny VLM's processor keeps 56 × 56 as it is: 8 × 8 patches, 16 tokens
CELL = 14  # one shape per cell of the 4 × 4 grid, aligned with the tower's merged 2 × 2 patches
PALETTE = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (40, 70, 220)}
BACKGROUND = (255, 255, 255)
MAX_SHAPES = 6
MAX_COUNT = 4  # no colour has more shapes than this: answers are 0 to 4
QUESTION = "{color}?"


def draw(rng: random.Random):
    """(a 56 × 56 RGB picture, the asked colour's name, how many shapes have it). Each shape's colour
    is drawn from 2 or 3 of the palette's, and the question asks one of those: with few shapes it may
    have none (answer 0, a fifth of the rows). Answers 0 to 4 come about 23/33/25/14/5 % of the time."""
    from PIL import Image, ImageDraw  # noqa: PLC0415  (PIL: on use)

    names = list(PALETTE)
    used = rng.sample(names, rng.choice((2, 3)))
    n = rng.randint(1, MAX_SHAPES)
    while True:  # redraw until no colour exceeds MAX_COUNT (only 5 or 6 shapes in 2 colours can)
        colors = [rng.choice(used) for _ in range(n)]
        if max(colors.count(c) for c in used) <= MAX_COUNT:
            break
    cells_per_row = SIZE // CELL
    cells = rng.sample(range(cells_per_row**2), n)
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(img)
    for cell, color in zip(cells, colors):
        side = rng.randint(10, 12)
        # a margin of at least 1 px inside the cell: shapes in neighbouring cells never touch
        x = (cell % cells_per_row) * CELL + rng.randint(1, CELL - 1 - side)
        y = (cell // cells_per_row) * CELL + rng.randint(1, CELL - 1 - side)
        box = (x, y, x + side - 1, y + side - 1)
        if rng.random() < 0.5:
            pen.rectangle(box, fill=PALETTE[color])
        else:
            pen.ellipse(box, fill=PALETTE[color])
    asked = rng.choice(used)
    return img, asked, colors.count(asked)


def shapes_row(rng: random.Random) -> dict:
    """One row: the question as a user message with an image part, its picture in `images`, the count
    as the answer string."""
    img, color, count = draw(rng)
    content = [{"type": "image"}, {"type": "text", "text": QUESTION.format(color=color)}]
    return {"prompt": [{"role": "user", "content": content}], "images": [img], "answer": str(count), "task": "shapes"}


# -- shapes_turns: three pictures in one episode, the later two shown by the environment -------------

TURNS = 3  # pictures per episode: the prompt's, then two the environment shows after each answer


def turns_row(rng: random.Random) -> dict:
    """A `shapes_turns` row: a `shapes` row whose episode goes on (`ShapesTurns`): `seed` draws the
    later pictures, `answers` holds every turn's count."""
    row = shapes_row(rng)
    seed = rng.randrange(2**31)
    later = random.Random(seed)
    answers = [row["answer"]] + [str(draw(later)[2]) for _ in range(TURNS - 1)]
    return {**row, "seed": seed, "answers": ",".join(answers), "task": "shapes_turns"}


class ShapesTurns:
    """`shapes_turns`' environment (the TRL contract, docs/agentic.md): after each answer it shows the
    next picture with its question (the text hook, a screenshot a turn) until TURNS pictures were
    asked; the reward (`env`) is the share of the turns answered right."""

    def reset(self, **row) -> None:
        self.later = random.Random(int(row["seed"]))
        self.answers = row["answers"].split(",")
        self.given: list[str] = []

    def env_response(self, text: str):
        self.given.append(text.strip())
        if len(self.given) >= TURNS:
            return None
        img, color, _ = draw(self.later)
        return {"image": img, "text": QUESTION.format(color=color)}

    def get_reward(self) -> float:
        return sum(g == a for g, a in zip(self.given, self.answers)) / TURNS
