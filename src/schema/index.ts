import { lexicographicSortSchema, printSchema, type GraphQLSchema } from 'graphql';
import { builder } from './builder.js';
import './execution.js';
import './procedure.js';
import './invoke.js';
import './subscription.js';
import './batch.js';
import './apiKeys.js';
import './schedules.js';
import './node.js';
import './viewer.js';

export type { Context, Limits } from './builder.js';

export const schema: GraphQLSchema = builder.toSchema();

/** The SDL kept in schema/schema.graphql. */
export function printedSchema(): string {
  return `${printSchema(lexicographicSortSchema(schema))}\n`;
}
