import { useEffect, useRef } from 'preact/hooks';
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

/** Steps between the ticks of a count axis. */
const COUNT_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000];

/** A small bar chart over time (uPlot); `data` is [x (unix seconds), y]. Colours come from the theme's CSS variables. */
export function BarChart({ data, label, colorVar }: { data: [number[], number[]]; label: string; colorVar: string }) {
  const host = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  useEffect(() => {
    const element = host.current!;
    const css = getComputedStyle(element);
    const color = css.getPropertyValue(colorVar).trim() || '#2563eb';
    const axis = css.getPropertyValue('--muted').trim() || '#888';
    const grid = css.getPropertyValue('--line').trim() || '#ddd';
    const width = () => Math.max(200, element.clientWidth);
    const made = new uPlot(
      {
        width: width(),
        height: 140,
        legend: { show: false },
        cursor: { show: true, drag: { x: false, y: false } },
        scales: { x: { time: true }, y: { range: (_u, _min, max) => [0, Math.max(1, Math.ceil(max * 1.15))] } },
        axes: [
          // room for a label like "10:00am" between two ticks (they ran together at two-digit hours)
          { stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid }, space: 72 },
          // counts: whole numbers only (no 0.5 tick)
          { stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid }, size: 36, incrs: COUNT_STEPS },
        ],
        series: [{}, { label, stroke: color, fill: color, paths: uPlot.paths.bars!({ size: [0.8, 40] }), points: { show: false } }],
      },
      data,
      element,
    );
    plot.current = made;
    const resize = new ResizeObserver(() => made.setSize({ width: width(), height: 140 }));
    resize.observe(element);
    return () => {
      resize.disconnect();
      made.destroy();
      plot.current = null;
    };
  }, [label, colorVar]);
  useEffect(() => plot.current?.setData(data), [data]);
  return <div class="chart" ref={host} role="img" aria-label={label} data-total={data[1].reduce((a, b) => a + b, 0)} />;
}
