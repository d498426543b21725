// Package dedup records the keys of processed messages in the database, in the same
// transaction as the messages' business writes, so that a redelivered message is recognised
// and acknowledged without being processed again.
//
// A Key is a handler name, a message id and an optional timestamp, as in a classic message_log
// table (docs/background.md).
// Record inserts it first thing in the transaction (insert-first): true means the message is
// new and must be processed; false means a committed transaction already recorded it, and the
// message is a duplicate. Because the key commits or rolls back with the business writes,
// every message's effect is in the database exactly once:
//
//   - the transaction rolls back: the key goes with it, and the redelivery is processed;
//   - it commits but the broker ack is lost: the redelivery finds the key, is a duplicate;
//   - two copies are processed at once on two nodes: the second Record waits for the first
//     transaction's row lock, then reports a duplicate (or, if the first rolled back, new).
//
// Lookup is the check-first variant, an id mapper's: it reads the internal id recorded for a key
// without writing, so that a duplicate can be acknowledged before any work starts. It is an
// optimisation; Record in the transaction remains the arbiter.
//
// # Storage
//
// SQLStore keeps the keys in one table per store, on PostgreSQL, MySQL/MariaDB or SQLite (the
// dialect of the sqldb.DB). Migrate creates it:
//
//	handler     VARCHAR(200)  part of the primary key
//	message_id  VARCHAR(255)  part of the primary key
//	message_ts  BIGINT        part of the primary key, 0 when the key has no timestamp
//	internal_id VARCHAR(64)   NULL when recorded without one
//	created_at  BIGINT        when the key was recorded, Unix microseconds
//	expires_at  BIGINT        created_at + Retention, Unix microseconds, indexed
//
// MySQL tables also have batch_token, by which RecordMany tells the rows it wrote (MariaDB 10.5
// and later return them from the INSERT itself; MySQL, which has no RETURNING, reads them
// back). Ids compare
// byte by byte on every dialect: "ABC", "abc" and "abc " are three keys (on MySQL and MariaDB
// through a binary, no-pad collation).
//
// None of the statements fails on an existing key, so a duplicate never leaves the caller's
// transaction unusable, not even on PostgreSQL, where any failed statement aborts it. Keys that
// cannot be stored (empty message id, longer than their column, not UTF-8) are rejected with
// ErrInvalidKey or ErrKeyTooLong before a statement runs.
//
// # Expiry and purging
//
// A key expires Config.Retention after it was recorded (seven days by default; the id mapper
// of docs/background.md kept its mappings for 24 hours). An expired key is no longer a duplicate: Record replaces it
// and Lookup does not find it. Retention must therefore outlive the longest time the broker
// may take to redeliver a message, dead-letter replays included.
//
// Expired rows stay in the table until Purge deletes them, in short batches, from one process
// at a time. Run it periodically (the onceflow command's purge, or a ticker in one service);
// Stats reports the rows, the expired rows waiting for a purge and the oldest row, for gauges.
//
// # Group commit
//
// Past the database's commit rate, several messages share one transaction. RecordMany records
// all their keys with one multi-row statement and reports which are new; Forget removes the key
// of a member whose own writes were rolled back to a savepoint, so that its redelivery is
// processed.
package dedup
