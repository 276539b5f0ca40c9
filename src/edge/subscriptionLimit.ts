import { GraphQLError } from 'graphql';

/**
 * graphql-ws: a socket holding `max` operations already gets TOO_MANY_SUBSCRIPTIONS for the next subscribe
 * (the socket and its other subscriptions stay up). Call from `onSubscribe`, where the new id is already counted.
 */
export function refuseBeyondSubscriptionLimit(ctx: { subscriptions: Record<string, unknown> }, max: number): GraphQLError[] | undefined {
  if (Object.keys(ctx.subscriptions).length <= max) return undefined;
  return [new GraphQLError(`at most ${max} subscriptions per connection`, { extensions: { code: 'TOO_MANY_SUBSCRIPTIONS' } })];
}
