import { useEffect, useState } from 'preact/hooks';

/** The hash route's parts: `#/execution/<token>` → ['execution', token]; empty: the overview. */
export function currentRoute(): string[] {
  return location.hash.replace(/^#\/?/, '').split('/').filter(Boolean).map(decodeURIComponent);
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
