import { readdir, readFile } from 'node:fs/promises';

/** CPU time (ms) used so far by a PostgreSQL cluster: the postmaster, its children, and its children that have exited. */
export async function clusterCpuMs(postmasterPid: number): Promise<number> {
  let ticks = 0;
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const stat = await readFile(`/proc/${entry}/stat`, 'utf8').catch(() => '');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    if (Number(fields[1]) === postmasterPid) ticks += Number(fields[11]) + Number(fields[12]);
    if (Number(entry) === postmasterPid) ticks += Number(fields[11]) + Number(fields[12]) + Number(fields[13]) + Number(fields[14]);
  }
  return ticks * 10; // USER_HZ = 100
}
