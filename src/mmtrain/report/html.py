"""The report page: one self-contained HTML file.

PNGs are embedded as `data:image/png;base64,...` URIs and the CSS is inline, so the file opens
from disk in any browser, can be mailed or attached to a ticket, and works offline: no script,
no server, no external URL. All text from the run (keys, captions, paths) is HTML-escaped.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from mmtrain.report.plots import Plot

CSS = """
:root { color-scheme: light; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1b1f24; background: #f6f7f9; margin: 0; }
main { max-width: 1240px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 26px; margin: 0 0 2px; }
h2 { font-size: 19px; margin: 34px 0 12px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
.sub { color: #57606a; margin: 0 0 18px; word-break: break-all; }
table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 2px rgba(0,0,0,.06); }
th, td { text-align: left; padding: 6px 14px; border-bottom: 1px solid #eaeef2;
         vertical-align: top; }
table.summary th { color: #57606a; font-weight: 600; white-space: nowrap; width: 1%; }
table.metrics td.num, table.metrics th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.metrics thead th { background: #f0f3f6; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 18px; }
figure { margin: 0; background: #fff; padding: 12px 14px 10px; border-radius: 6px;
         box-shadow: 0 1px 2px rgba(0,0,0,.08); }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-weight: 600; margin-bottom: 6px; }
figure .note { color: #57606a; font-size: 13px; margin: 6px 0 0; }
figure.missing { background: #fbfbfc; border: 1px dashed #c7ced6; box-shadow: none;
                 align-self: start; }
figure.wide { grid-column: 1 / -1; }
ul.notes { color: #57606a; }
footer { color: #8c959f; font-size: 12px; margin-top: 40px; }
"""


@dataclass
class Table:
    """A titled table of strings; columns named in `numeric` are right-aligned."""

    title: str
    header: Sequence[str]
    rows: Sequence[Sequence[str]]
    numeric: Sequence[int] = ()


@dataclass
class Page:
    """What the report shows, in order: the diagnosis, summary, tables, plot sections, notes."""

    title: str
    subtitle: str
    summary: Sequence[tuple[str, str]]
    diagnosis: Table | None = None  # mmtrain doctor's findings: what to change first
    tables: Sequence[Table] = ()
    sections: Sequence[tuple[str, Sequence[Plot], bool]] = ()  # (heading, plots, full width)
    notes: Sequence[str] = ()
    footer: str = ""
    files: dict[str, str] = field(default_factory=dict)  # plot name -> PNG file name beside it


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def render_html(page: Page) -> str:
    """The whole report as one HTML document (UTF-8 text)."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(page.title)}</title>",
        f"<style>{CSS}</style>",
        "</head>",
        "<body><main>",
        f"<h1>{escape(page.title)}</h1>",
        f'<p class="sub">{escape(page.subtitle)}</p>',
    ]
    if page.diagnosis is not None:
        parts.append(_table(page.diagnosis))
    parts.append(_summary(page.summary))
    parts += [_table(table) for table in page.tables]
    for heading, plots, wide in page.sections:
        if plots:
            parts.append(f"<h2>{escape(heading)}</h2>")
            parts.append('<div class="grid">')
            parts += [_figure(plot, wide, page.files.get(plot.name)) for plot in plots]
            parts.append("</div>")
    if page.notes:
        parts.append("<h2>Notes</h2>")
        parts.append('<ul class="notes">')
        parts += [f"<li>{escape(note)}</li>" for note in page.notes]
        parts.append("</ul>")
    if page.footer:
        parts.append(f"<footer>{escape(page.footer)}</footer>")
    parts.append("</main></body>")
    parts.append("</html>")
    return "\n".join(parts) + "\n"


def _summary(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<h2>Summary</h2>\n<table class="summary">{body}</table>'


def _table(table: Table) -> str:
    def cell(tag: str, i: int, text: str) -> str:
        cls = ' class="num"' if i in table.numeric else ""
        return f"<{tag}{cls}>{escape(text)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(table.header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>"
        for row in table.rows
    )
    return (
        f"<h2>{escape(table.title)}</h2>\n"
        f'<table class="metrics"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    )


def _figure(plot: Plot, wide: bool, file: str | None) -> str:
    classes = [c for c in ("wide" if wide else "", "missing" if plot.png is None else "") if c]
    attr = f' class="{" ".join(classes)}"' if classes else ""
    caption = f"<figcaption>{escape(plot.title)}</figcaption>"
    note = f'<p class="note">{escape(plot.note)}</p>' if plot.note else ""
    if plot.png is None:
        return f'<figure{attr} id="{escape(plot.name)}">{caption}{note}</figure>'
    title = f"{plot.title} ({file})" if file else plot.title
    image = f'<img src="{data_uri(plot.png)}" alt="{escape(plot.title)}" title="{escape(title)}">'
    return f'<figure{attr} id="{escape(plot.name)}">{caption}{image}{note}</figure>'
