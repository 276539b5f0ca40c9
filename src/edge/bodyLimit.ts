import type { Plugin } from 'graphql-yoga';

function tooLarge(fetchAPI: { Response: typeof Response }, maxBytes: number): Response {
  return new fetchAPI.Response(
    JSON.stringify({ errors: [{ message: `request body exceeds ${maxBytes} bytes`, extensions: { code: 'PAYLOAD_TOO_LARGE' } }] }),
    // close: the rest of an oversized upload is never read
    { status: 413, headers: { 'content-type': 'application/json', connection: 'close' } },
  );
}

/**
 * Refuse a request body larger than the limit: a declared Content-Length over the limit unread; a body
 * without one (chunked) counting the bytes actually read, at most `maxBytes`, then handed on to yoga's
 * parsers as a buffer. The server turns yoga's own limit off (`maxRequestBodySize: false`): this one
 * answers first, and yoga's pipes every body through a TransformStream.
 */
export function useBodyLimit(maxBytes: number): Plugin {
  return {
    async onRequest({ request, setRequest, endResponse, fetchAPI }) {
      if (request.body == null || request.method === 'GET' || request.method === 'HEAD') return;
      const declared = request.headers.get('content-length');
      if (declared !== null) {
        if (Number(declared) > maxBytes) endResponse(tooLarge(fetchAPI, maxBytes));
        // HTTP/1.1 framing: the body is exactly that long (Node's parser refuses a malformed length, or
        // one beside Transfer-Encoding), so it needs no counting and yoga reads it as it came
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
