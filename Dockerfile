# asyncproc service image. Production runs against an existing database:
#   docker run -e DATABASE_URL=postgres://… -p 4000:4000 asyncproc
# (the embedded PostgreSQL is for development; this image refuses to start without DATABASE_URL)

FROM node:20-bookworm-slim AS build
WORKDIR /app
COPY package.json package-lock.json ./
# npm ci runs `prepare`, which builds the dashboard (Vite) into dashboard/dist
COPY dashboard ./dashboard
RUN npm ci --no-audit --no-fund
COPY tsconfig.json tsconfig.build.json ./
COPY src ./src
RUN npm run build

FROM node:20-bookworm-slim
ENV NODE_ENV=production \
    PORT=4000 \
    ASYNCPROC_EMBEDDED=false
WORKDIR /app
COPY package.json package-lock.json ./
# the built dashboard, served at /dashboard/; `prepare` finds no Vite here and keeps it
COPY --from=build /app/dashboard/dist ./dashboard/dist
COPY dashboard/prepare.mjs ./dashboard/
RUN npm ci --omit=dev --no-audit --no-fund && npm cache clean --force
COPY --from=build /app/dist ./dist
COPY sql ./sql
COPY schema ./schema
USER node
EXPOSE 4000
# /ready, not /health: unhealthy while the database, its schema or the listener is missing (README "Operations")
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD node -e "fetch('http://127.0.0.1:' + (process.env.PORT || 4000) + '/ready').then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))"
CMD ["node", "dist/cli.js", "serve"]
