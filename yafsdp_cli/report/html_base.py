"""The HTML page's frame and the pieces every page shares: escaping, tables from
``Section``s, stacked bars, the legend, the style sheet and the little script.

The page is one file: inline CSS, inline SVG and about sixty lines of plain
JavaScript (tooltips, expand/collapse all); nothing is fetched. Bars are SVGs
stretched to the page width (``preserveAspectRatio="none"``, strokes not scaled),
so text stays in HTML around them and nothing is drawn twice for two widths.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from .bars import PALETTE
from .formatting import Section, human_bytes

WIDTH = 1000  # SVG user units across a stretched bar


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def num(n: int) -> str:
    return f"{n:,}"


def x(v: float) -> str:
    """An SVG coordinate with no more digits than a screen can show."""
    return f"{v:.2f}".rstrip("0").rstrip(".")


def section_html(s: Section, cls: str = "") -> str:
    """A ``Section`` (the terminal's and markdown's table) as an HTML table."""
    head = ""
    if any(s.headers):
        head = "<thead><tr>" + "".join(_th(h, i in s.right) for i, h in enumerate(s.headers))
        head += "</tr></thead>"
    body = "".join(
        "<tr>" + "".join(_td(c, i in s.right) for i, c in enumerate(row)) + "</tr>"
        for row in s.rows
    )
    caption = f'<p class="caption">{esc(s.caption)}</p>' if s.caption else ""
    return (
        f'<div class="table {cls}"><h3>{esc(s.title)}</h3>'
        f"<table>{head}<tbody>{body}</tbody></table>{caption}</div>"
    )


def _th(text: str, right: bool) -> str:
    return f'<th class="r">{esc(text)}</th>' if right else f"<th>{esc(text)}</th>"


def _td(text: str, right: bool) -> str:
    return f'<td class="r">{esc(text)}</td>' if right else f"<td>{esc(text)}</td>"


@dataclass(frozen=True, slots=True)
class StackRow:
    key: str  # data-row: what a test or a script finds it by
    label: str
    parts: tuple[int, ...]  # bytes per category
    note: str = ""

    @property
    def total(self) -> int:
        return sum(self.parts)


def stacked_bars(kind: str, categories: Sequence[str], rows: Sequence[StackRow]) -> str:
    """One stretched SVG bar per row, all to one scale, with exact bytes on hover."""
    scale = max((r.total for r in rows), default=0)
    out = [f'<div class="stack" data-kind="{esc(kind)}">']
    for row in rows:
        out.append(
            f'<div class="stack-row" data-row="{esc(row.key)}">'
            f'<div class="stack-label">{esc(row.label)}</div>'
            f"{_stack_svg(categories, row, scale)}"
            f'<div class="stack-total" data-bytes="{row.total}" '
            f'title="{num(row.total)} B">{esc(human_bytes(row.total))}</div>'
            f'<div class="stack-note">{esc(row.note)}</div></div>'
        )
    out.append(
        legend(categories) + '<button type="button" class="rescale">each bar to its own '
        "length (shows what it is made of)</button></div>"
    )
    return "".join(out)


def _stack_svg(categories: Sequence[str], row: StackRow, scale: int) -> str:
    ends = _positions(row.parts, scale)
    rects = []
    for i, (label, nbytes) in enumerate(zip(categories, row.parts)):
        a, b = ends[i], ends[i + 1]
        tip = f"{label}: {human_bytes(nbytes)} ({num(nbytes)} B)"
        rects.append(
            f'<rect x="{x(a)}" width="{x(max(b - a, 0))}" height="20" fill="{color(i)}" '
            f'data-cat="{esc(label)}" data-bytes="{nbytes}"><title>{esc(tip)}</title></rect>'
        )
    return (
        f'<svg class="stack-bar" viewBox="0 0 {WIDTH} 20" preserveAspectRatio="none">'
        f'<rect class="track" width="{WIDTH}" height="20"/>{"".join(rects)}</svg>'
    )


def _positions(parts: Sequence[int], scale: int) -> list[float]:
    out, done = [0.0], 0
    for p in parts:
        done += p
        out.append(WIDTH * done / scale if scale else 0.0)
    return out


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def legend(categories: Sequence[str]) -> str:
    items = "".join(
        f'<span><i style="background:{color(i)}"></i>{esc(c)}</span>'
        for i, c in enumerate(categories)
    )
    return f'<div class="legend">{items}</div>'


def cards(items: Sequence[tuple[str, str, str]]) -> str:
    """Headline figures: (label, value, detail)."""
    body = "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div>'
        f'<div class="d">{esc(d)}</div></div>'
        for k, v, d in items
    )
    return f'<div class="cards">{body}</div>'


def notes_html(title: str, lines: Sequence[str]) -> str:
    items = "".join(f"<li>{esc(line)}</li>" for line in lines)
    return f'<section id="notes"><h2>{esc(title)}</h2><ul class="notes">{items}</ul></section>'


def page(title: str, subtitle: str, nav: Sequence[tuple[str, str]], body: str) -> str:
    """The whole document: ``nav`` is (anchor, label) pairs of the page's sections."""
    links = "".join(f'<a href="#{esc(a)}">{esc(label)}</a>' for a, label in nav)
    # the button opens and closes <details>: only a page that has some shows it
    button = (
        '<button type="button" id="expand-all">expand all</button>' if "<details" in body else ""
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f"{DEFS}<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p><nav>{links}"
        f"{button}</nav></header>"
        f'<main>{body}</main><div id="tip" hidden></div>'
        "<footer>made by yafsdp &middot; one self-contained file: no network, "
        "no scripts from elsewhere &middot; GiB = 1024<sup>3</sup> bytes</footer>"
        f"<script>{JS}</script></body></html>\n"
    )


DEFS = (
    '<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
    '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3f4f6"/>'
    '<line x1="0" y1="0" x2="0" y2="6" stroke="#c4c8cf" stroke-width="3"/></pattern>'
    "</defs></svg>"
)

CSS = """
:root{--fg:#1f2328;--mute:#656d76;--line:#d8dee4;--bg:#f6f8fa;--card:#fff;--accent:#4c78a8}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
color:var(--fg);background:var(--bg)}
header{background:#1f2a37;color:#fff;padding:18px 28px 12px}
header h1{margin:0;font-size:20px;font-weight:600}
header p{margin:4px 0 10px;color:#c9d1d9}
nav{display:flex;gap:14px;align-items:center;flex-wrap:wrap}
nav a{color:#9ecbff;text-decoration:none}
nav button{margin-left:auto;background:#2f3d4f;color:#fff;border:1px solid #4b5b70;
border-radius:6px;padding:3px 10px;cursor:pointer}
main{padding:8px 28px 28px;max-width:1400px}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;
padding:14px 18px;margin:16px 0}
h2{font-size:16px;margin:0 0 10px}
h3{font-size:13px;margin:12px 0 6px;color:var(--mute);font-weight:600}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(160px,1fr));gap:10px}
.card{border:1px solid var(--line);border-radius:8px;padding:8px 12px;background:#fbfcfd}
.card .k{color:var(--mute);font-size:12px}.card .v{font-size:18px;font-weight:600}
.card .d{color:var(--mute);font-size:12px}
.stack-row{display:grid;grid-template-columns:150px 1fr 100px 100px;gap:10px;
align-items:center;margin:5px 0}
.stack-label{font-weight:600}.stack-total{text-align:right;font-variant-numeric:tabular-nums}
.stack-note{color:var(--mute);font-size:12px}
svg.stack-bar{width:100%;height:20px;display:block}
.track{fill:#eef1f4}
button.rescale{margin:8px 0 0 160px;background:#fff;border:1px solid var(--line);
border-radius:6px;padding:2px 10px;color:var(--accent);cursor:pointer}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:8px 0 0 160px;color:var(--mute);
font-size:12px}
.legend i{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;
vertical-align:-1px}
.buf{margin:12px 0 16px}
.buf-head{display:flex;gap:10px;align-items:baseline;flex-wrap:wrap}
.buf-name{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-weight:600}
.buf-facts,.buf-axis{color:var(--mute);font-size:12px}
.buf-axis{display:flex;justify-content:space-between;margin-top:1px;font-size:11px}
.bar-wrap{position:relative;margin-top:4px}
svg.buffer-bar{width:100%;height:46px;display:block;cursor:crosshair}
.labels span,.rank-labels span{position:absolute;overflow:hidden;white-space:nowrap;
text-overflow:ellipsis;pointer-events:none;box-sizing:border-box}
.labels span{top:0;height:30px;line-height:30px;padding:0 5px;color:#fff;font-size:11px;
text-shadow:0 0 2px rgba(0,0,0,.45)}
.rank-labels span{top:34px;height:12px;line-height:12px;text-align:center;color:#fff;
font-size:9px}
svg.buffer-bar .e{stroke:#fff;stroke-width:1;vector-effect:non-scaling-stroke}
svg.buffer-bar .e:hover{opacity:.75}
.cut{stroke:#b00020;stroke-width:1.5;vector-effect:non-scaling-stroke}
.rank-even{fill:#5b6b7f}.rank-odd{fill:#aab4c0}
details{margin:6px 0}summary{cursor:pointer;color:var(--accent)}
.group{border-left:3px solid var(--line);padding-left:12px;margin:8px 0}
table{border-collapse:collapse;font-size:12.5px;margin:4px 0}
th,td{border-bottom:1px solid var(--line);padding:3px 10px;text-align:left;
font-variant-numeric:tabular-nums}
th{background:#f3f5f7}td.r,th.r{text-align:right}
.caption{color:var(--mute);font-size:12px;margin:4px 0}
.notes{color:var(--mute);margin:0;padding-left:18px}
.verdict{font-size:16px;font-weight:600;padding:10px 14px;border-radius:8px}
.pass{background:#e6f4ea;color:#1e6b35}.fail{background:#fdecea;color:#a61b1b}
.heat td.cell{text-align:center;font-weight:600}
#tip{position:fixed;pointer-events:none;background:#1f2a37;color:#fff;font-size:12px;
padding:6px 9px;border-radius:6px;max-width:560px;white-space:pre-line;z-index:9;
box-shadow:0 2px 8px rgba(0,0,0,.25)}
footer{color:var(--mute);font-size:12px;padding:0 28px 24px}
svg.chart{width:100%;height:auto;display:block}
svg.chart text{font:12px system-ui,sans-serif;fill:#57606a}
"""

JS = """
(function(){
const tip=document.getElementById('tip');
function show(e,text){tip.textContent=text;tip.hidden=false;
 const w=tip.offsetWidth;tip.style.left=Math.min(e.clientX+14,innerWidth-w-8)+'px';
 tip.style.top=(e.clientY+16)+'px';}
function hide(){tip.hidden=true;}
for(const t of document.querySelectorAll('svg title')){  // our tooltip replaces the native one
 t.parentNode.dataset.tip=t.textContent;t.remove();}
for(const el of document.querySelectorAll('[data-tip]')){
 if(el.closest('svg.buffer-bar'))continue;
 el.addEventListener('mousemove',e=>show(e,el.dataset.tip));el.addEventListener('mouseleave',hide);}
function entries(svg){
 if(!svg._e){svg._e=[...svg.querySelectorAll('rect.e')].map(r=>
  [Number(r.dataset.o),Number(r.dataset.n),r.dataset.tip||'']);}
 return svg._e;}
function find(list,at){let lo=0,hi=list.length-1;
 while(lo<=hi){const m=(lo+hi)>>1,[o,n]=list[m];
  if(at<o)hi=m-1;else if(at>=o+n)lo=m+1;else return list[m];}
 return null;}
const fmt=n=>n.toLocaleString('en-US');
for(const svg of document.querySelectorAll('svg.buffer-bar')){
 svg.addEventListener('mousemove',e=>{
  const b=svg.getBoundingClientRect(),padded=Number(svg.dataset.padded),
   shard=Number(svg.dataset.shard),ws=Number(svg.dataset.ws);
  const at=Math.min(padded-1,Math.max(0,Math.floor((e.clientX-b.left)/b.width*padded)));
  const hit=find(entries(svg),at),r=Math.floor(at/shard);
  let text=hit?hit[2]:'padding (zeros) at flat['+fmt(at)+']';
  if(ws>1)text+='\\nunder the cursor: rank '+r+' of '+ws+', which owns flat['+
   fmt(r*shard)+':'+fmt((r+1)*shard)+']';
  show(e,text);});
 svg.addEventListener('mouseleave',hide);}
for(const b of document.querySelectorAll('button.rescale')){  // one scale <-> each its own
 const label=b.textContent;
 b.addEventListener('click',()=>{const own=!b.dataset.own;b.dataset.own=own?'1':'';
  b.textContent=own?'one scale for all bars':label;
  const rows=[...b.parentNode.querySelectorAll('.stack-row')];
  const tot=r=>[...r.querySelectorAll('rect[data-bytes]')]
   .reduce((s,e)=>s+Number(e.dataset.bytes),0);
  const top=Math.max(...rows.map(tot));
  for(const r of rows){const scale=own?tot(r):top;let at=0;
   for(const e of r.querySelectorAll('rect[data-bytes]')){
    const w=scale?1000*Number(e.dataset.bytes)/scale:0;
    e.setAttribute('x',at);e.setAttribute('width',w);at+=w;}}});}
const btn=document.getElementById('expand-all');
if(btn)btn.addEventListener('click',()=>{const all=document.querySelectorAll('details');
 const open=btn.textContent==='expand all';for(const d of all)d.open=open;
 btn.textContent=open?'collapse all':'expand all';});
})();
"""
