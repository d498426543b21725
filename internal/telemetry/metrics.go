package telemetry

import (
	"go.opentelemetry.io/otel/metric"
)

// Metric names. docs/observability.md lists each with its attributes.
const (
	MetricMessages         = "onceflow.messages"
	MetricProcessDuration  = "onceflow.process.duration"
	MetricInflight         = "onceflow.inflight"
	MetricRetries          = "onceflow.retries"
	MetricCommitToAck      = "onceflow.commit_to_ack.duration"
	MetricAckFailures      = "onceflow.ack.failures"
	MetricDedupRows        = "onceflow.dedup.rows"
	MetricDedupOldestAge   = "onceflow.dedup.oldest_age"
	MetricOutboxBacklog    = "onceflow.outbox.backlog"
	MetricOutboxLag        = "onceflow.outbox.lag"
	MetricOrderParked      = "onceflow.order.parked"
	MetricOrderGapTimeouts = "onceflow.order.gap_timeouts"
)

// Instruments are the synchronous instruments shared by the Metrics middleware and the router.
type Instruments struct {
	Messages        metric.Int64Counter
	ProcessDuration metric.Float64Histogram
	Inflight        metric.Int64UpDownCounter
	Retries         metric.Int64Counter
	CommitToAck     metric.Float64Histogram
	AckFailures     metric.Int64Counter
}

// latencyBuckets suit message processing: from 100 µs to 10 s.
var latencyBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// NewInstruments creates the instruments on meter.
func NewInstruments(meter metric.Meter) (*Instruments, error) {
	var ins Instruments
	var err error
	if ins.Messages, err = meter.Int64Counter(MetricMessages, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries handled, by handler and outcome (processed, duplicate, dead_lettered, failed, panicked).")); err != nil {
		return nil, err
	}
	if ins.ProcessDuration, err = meter.Float64Histogram(MetricProcessDuration, metric.WithUnit("s"),
		metric.WithDescription("Time from the start of the chain to its outcome, retries included."),
		metric.WithExplicitBucketBoundaries(latencyBuckets...)); err != nil {
		return nil, err
	}
	if ins.Inflight, err = meter.Int64UpDownCounter(MetricInflight, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries being processed now.")); err != nil {
		return nil, err
	}
	if ins.Retries, err = meter.Int64Counter(MetricRetries, metric.WithUnit("{attempt}"),
		metric.WithDescription("Processing attempts after the first, by handler.")); err != nil {
		return nil, err
	}
	if ins.CommitToAck, err = meter.Float64Histogram(MetricCommitToAck, metric.WithUnit("s"),
		metric.WithDescription("Time from the database commit to the broker acknowledgement."),
		metric.WithExplicitBucketBoundaries(latencyBuckets...)); err != nil {
		return nil, err
	}
	if ins.AckFailures, err = meter.Int64Counter(MetricAckFailures, metric.WithUnit("{message}"),
		metric.WithDescription("Acknowledgements that failed after a successful commit; the broker redelivers and deduplication absorbs the copy.")); err != nil {
		return nil, err
	}
	return &ins, nil
}
