/**
 * JSON from the database, parsed without losing numbers. A bigint past 2^53 or a numeric
 * with more digits than a double keeps would silently change in JSON.parse
 * (9007199254740993 becomes 9007199254740992); such numbers are kept as strings holding
 * their exact decimal text, every other number stays a number.
 */

/** A JSON string (skipped as is) or a JSON number (checked). */
const TOKEN = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g;

/** Digits without leading/trailing zeros and the power of ten they are scaled by: equal values, equal forms. */
function canonical(number: string): string {
  const match = /^(-?)(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?$/.exec(number);
  if (!match) return number;
  const [, sign, whole, fraction = '', exponent = '0'] = match;
  let digits = (whole + fraction).replace(/^0+/, '');
  let scale = Number(exponent) - fraction.length;
  if (!digits) return '0';
  const trailing = digits.length - digits.replace(/0+$/, '').length;
  digits = digits.slice(0, digits.length - trailing);
  scale += trailing;
  return `${sign}${digits}e${scale}`;
}

/** Whether JavaScript's number for this JSON number is exactly it (integers: within ±(2^53−1)). */
export function isExactNumber(number: string): boolean {
  const value = Number(number);
  if (/^-?\d+$/.test(number)) return Number.isSafeInteger(value);
  return Number.isFinite(value) && canonical(String(value)) === canonical(number);
}

/**
 * Text that may hold an inexact number: an exponent, or a run of 16 digits and dots. A number
 * with neither has at most 15 significant digits, which a double always holds exactly, so
 * such text (nearly every row) goes straight to JSON.parse, with the same result.
 */
const MAYBE_INEXACT = /\d[eE]|\d[\d.]{15}/;

export function parseExactJson(text: string): unknown {
  if (!MAYBE_INEXACT.test(text)) return JSON.parse(text);
  return JSON.parse(text.replace(TOKEN, (token) => (token.startsWith('"') || isExactNumber(token) ? token : `"${token}"`)));
}
