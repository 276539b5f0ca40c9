import type { Plugin } from 'graphql-yoga';

function tooLarge(fetchAPI: { Response: typeof Response }, maxBytes: number): Response {
  return new fetchAPI.Response(
    JSON.stringify({ errors: [{ message: `request body exceeds ${maxBytes} bytes`, extensions: { code: 'PAYLOAD_TOO_LARGE' } }] }),
    // close: the rest of an oversized upload is never read
    { status: 413, headers: { 'content-type': 'application/json', connection: 'close' } },
  );
}

/**
 * Refuse a request body larger than the limit, counting the bytes actually read whatever the transfer
 * encoding (a chunked body declares no length); a declared Content-Length over the limit is refused unread.
 * The body is read here, at most `maxBytes`, and handed on to yoga's parsers as a buffer.
 */
export function useBodyLimit(maxBytes: number): Plugin {
  return {
    async onRequest({ request, setRequest, endResponse, fetchAPI }) {
      if (request.body == null || request.method === 'GET' || request.method === 'HEAD') return;
      if (Number(request.headers.get('content-length') ?? '0') > maxBytes) {
        endResponse(tooLarge(fetchAPI, maxBytes));
        return;
      }
      const reader = request.body.getReader();
      const chunks: Uint8Array[] = [];
      let length = 0;
      for (let read = await reader.read(); !read.done; read = await reader.read()) {
        length += read.value.byteLength;
        if (length > maxBytes) {
          await reader.cancel().catch(() => undefined);
          endResponse(tooLarge(fetchAPI, maxBytes));
          return;
        }
        chunks.push(read.value);
      }
      const headers = new fetchAPI.Headers(request.headers);
      headers.delete('transfer-encoding');
      headers.set('content-length', String(length));
      // the signal goes along: an SSE stream still ends when its client goes away
      setRequest(new fetchAPI.Request(request.url, { method: request.method, headers, body: Buffer.concat(chunks), signal: request.signal }));
    },
  };
}
