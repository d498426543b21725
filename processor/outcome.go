package processor

// Outcome is what became of one delivery, as the router acts on it.
type Outcome string

// The outcomes, one per row of the table in the package documentation.
const (
	// Processed: the effect was committed; the message is acked.
	Processed Outcome = "processed"
	// Duplicate: the message was processed before; it is acked without being applied again.
	Duplicate Outcome = "duplicate"
	// DeadLettered: the message failed permanently and was published to the dead-letter topic;
	// it is acked.
	DeadLettered Outcome = "dead_lettered"
	// Failed: processing failed with an error that may heal, or a permanent error that could
	// not be dead-lettered; the message is nacked and redelivered.
	Failed Outcome = "failed"
	// Panicked: the processor panicked; the transaction was rolled back and the message is
	// nacked.
	Panicked Outcome = "panicked"
)

// OutcomeOf classifies the error returned by a processor or a chain.
func OutcomeOf(err error) Outcome {
	switch {
	case err == nil:
		return Processed
	case IsDeadLettered(err):
		return DeadLettered
	case IsDuplicate(err):
		return Duplicate
	case IsPanic(err):
		return Panicked
	}
	return Failed
}

// Acks reports whether the router acknowledges a delivery with this outcome.
func (o Outcome) Acks() bool { return o == Processed || o == Duplicate || o == DeadLettered }
