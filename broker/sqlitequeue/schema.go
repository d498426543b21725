package sqlitequeue

import "github.com/onceflow/onceflow/internal/queuetable"

// The tables of the queue are internal/queuetable's, which the outbox on SQLite writes too.

// ErrInvalidTopic reports a topic name the queue cannot store.
var ErrInvalidTopic = queuetable.ErrInvalidTopic

// CheckTopic reports whether topic can name a queue topic: 1 to 200 characters, each a letter,
// digit, '-', '$', ':', '.' or '_'. The error wraps ErrInvalidTopic and names the topic.
func CheckTopic(topic string) error { return queuetable.CheckTopic(topic) }

// MessagesTable returns the unquoted name of topic's messages table: "onceflow_queue_" and the
// topic, with each upper-case letter X written "^x" (SQLite table names ignore case).
func MessagesTable(topic string) string { return queuetable.MessagesTable(topic) }

// OffsetsTable returns the unquoted name of topic's offsets table: "onceflow_offsets_" and the
// topic, spelled as in MessagesTable.
func OffsetsTable(topic string) string { return queuetable.OffsetsTable(topic) }

// SchemaAdapter is the watermill-sql SchemaAdapter of the queue's messages tables, for
// watermill-sql subscribers over tables of this form (onceflow's outbox relay on SQLite keeps
// its outbox so). The queue's Publisher writes through its InsertQuery; its Subscriber reads
// the tables itself. BatchSize is the number of messages SelectQuery reads at once, 16 by
// default.
type SchemaAdapter = queuetable.SchemaAdapter

// OffsetsAdapter is the watermill-sql OffsetsAdapter of the queue's offsets tables, one row
// per consumer group. For a watermill-sql subscriber it is the offset of the last message the
// group acknowledged; the queue's own Subscriber keeps its cursor there instead (see
// Queue.Subscriber).
type OffsetsAdapter = queuetable.OffsetsAdapter

func quote(name string) string { return queuetable.Quote(name) }
