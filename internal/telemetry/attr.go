package telemetry

import (
	"go.opentelemetry.io/otel/attribute"
)

// Attribute keys that onceflow adds to the OpenTelemetry semantic conventions, on spans and
// metrics. docs/observability.md says which carries which.
const (
	// AttrHandler is the handler name (Handler.Name).
	AttrHandler = attribute.Key("onceflow.handler")
	// AttrOutcome is the processor.Outcome of a delivery: processed, duplicate, dead_lettered,
	// failed or panicked.
	AttrOutcome = attribute.Key("onceflow.outcome")
	// AttrGroupSize is the number of members of the group whose transaction committed a
	// message, on its onceflow.commit span.
	AttrGroupSize = attribute.Key("onceflow.group.size")
	// AttrAttempts is the number of processing attempts a delivery took, on the consumer span.
	AttrAttempts = attribute.Key("onceflow.attempts")
	// AttrAttempt is the number of one processing attempt, from 1, on the onceflow.process span.
	AttrAttempt = attribute.Key("onceflow.attempt")
	// AttrReason is why a message was counted where a metric has several causes, such as
	// expired_key or old_message on onceflow.dedup.beyond_retention.
	AttrReason = attribute.Key("onceflow.reason")
	// AttrDedupTable is the table of a duplicate-detection store, on the dedup gauges.
	AttrDedupTable = attribute.Key("onceflow.dedup.table")
)
