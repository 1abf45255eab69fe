"""Screenshots of a training run's TensorBoard pages (docs/tensorboard.md's figures).

TensorBoard's pages are drawn by JavaScript, so a headless browser renders them: Debian's
``chromium`` driven by ``playwright`` (``pip install playwright``; its own browser download is
not needed: the system's Chromium is used). Start TensorBoard first::

    python train.py --smoke --out runs/smoke
    tensorboard --logdir runs/smoke/tb --port 6123 &
    python scripts/tensorboard_screenshots.py http://127.0.0.1:6123 docs/tensorboard

Each page is saved as a PNG of at most 64 colours (a few tens of kB).
"""

from __future__ import annotations

import argparse
from pathlib import Path

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
PAGES: dict[str, str] = {
    # the teacher's caps, goodput and attainment, one chart per bucket
    "scalars": "#scalars&_smoothingWeight=0&tagFilter=teacher%2F(batch_cap%7Cgoodput_rps"
               "%7Csla_attainment)%2F",
    "custom_scalars": "#custom_scalars&_smoothingWeight=0",
    "histograms": "#histograms&tagFilter=%5E(teacher%7Cselect)%2F",
    "hparams": "#hparams",
}
"""Page name -> TensorBoard URL fragment."""
OPEN_LEGENDS = 3
"""Custom-scalar charts whose list of matched tags (the legend: bucket names) is opened."""


def shoot(url: str, out: Path, *, chromium: str = "/usr/bin/chromium",
          settle_ms: int = 6000) -> list[Path]:
    """Save every page of :data:`PAGES` as ``out/<page>.png``.

    :param url: TensorBoard's address.
    :param out: the folder (created).
    :param chromium: the browser's executable.
    :param settle_ms: how long a page may load and draw before its screenshot.
    """
    from PIL import Image
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    saved = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=CHROMIUM_ARGS)
        for name, fragment in PAGES.items():
            # the hparams table puts the run's figures right of its first few options
            wide = name == "hparams"
            page = browser.new_page(viewport={"width": 2200 if wide else 1400,
                                              "height": 700 if wide else 1000})
            page.goto(f"{url.rstrip('/')}/{fragment}")
            page.wait_for_timeout(settle_ms)
            if name == "custom_scalars":
                legends = page.get_by_text("Matches (")
                for i in range(min(legends.count(), OPEN_LEGENDS)):
                    legends.nth(i).evaluate(
                        "e => e.parentElement.querySelector('.toggle-matches-button').click()")
                page.wait_for_timeout(1500)
            path = out / f"{name}.png"
            page.screenshot(path=str(path))
            Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)
            saved.append(path)
        browser.close()
    return saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="TensorBoard's address, e.g. http://127.0.0.1:6123")
    p.add_argument("out", type=Path, help="folder of the PNGs")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    for path in shoot(args.url, args.out, chromium=args.chromium):
        print(path)


if __name__ == "__main__":
    main()
