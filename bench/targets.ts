/** The closing table of `npm run bench`: every target of the performance issue, ours, the peer's, the ratio. */
import { mid } from './measure.js';

export interface Target {
  target: string;
  ours: string;
  peer: string;
  ratio: string;
  /** null: no threshold, or not measured. */
  met: boolean | null;
}

/** The median of same-round ratios against a threshold the ratio must reach (or, 'at most', stay under). */
export function ratioCell(ratios: number[], threshold: number, direction: 'at least' | 'at most' = 'at least'): Pick<Target, 'ratio' | 'met'> {
  const ratio = mid(ratios);
  const range = ratios.length > 1 ? ` [${Math.min(...ratios).toFixed(2)}–${Math.max(...ratios).toFixed(2)}]` : '';
  return { ratio: `${ratio.toFixed(2)}×${range}`, met: direction === 'at least' ? ratio >= threshold : ratio <= threshold };
}

export function printTargets(targets: Target[]): void {
  const rows = [['target', 'ours', 'peer (same run)', 'ratio', 'met'], ...targets.map((t) => [t.target, t.ours, t.peer, t.ratio, t.met === null ? '-' : t.met ? 'yes' : 'NO'])];
  const widths = rows[0].map((_, i) => Math.max(...rows.map((r) => r[i].length)));
  const line = (r: string[]) => `| ${r.map((cell, i) => cell.padEnd(widths[i])).join(' | ')} |`;
  console.log('\ntargets of the performance issue (PostgreSQL engine, same run)');
  console.log(line(rows[0]));
  console.log(`|${widths.map((w) => '-'.repeat(w + 2)).join('|')}|`);
  for (const r of rows.slice(1)) console.log(line(r));
}
