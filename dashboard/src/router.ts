import { useEffect, useState } from 'preact/hooks';

/** A part as written when it is not valid percent-encoding (`%E0%A4%A`): a link cut short must not blank the page. */
function decoded(part: string): string {
  try {
    return decodeURIComponent(part);
  } catch {
    return part;
  }
}

/** The hash route's parts: `#/execution/<token>` → ['execution', token]; empty: the overview. */
export function currentRoute(): string[] {
  return location.hash.replace(/^#\/?/, '').split('/').filter(Boolean).map(decoded);
}

export function useRoute(): string[] {
  const [route, setRoute] = useState(currentRoute());
  useEffect(() => {
    const changed = () => setRoute(currentRoute());
    addEventListener('hashchange', changed);
    return () => removeEventListener('hashchange', changed);
  }, []);
  return route;
}

export function navigate(path: string) {
  location.hash = `#${path}`;
}
