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
	MetricGroupSize        = "onceflow.group.size"
	MetricAckFailures      = "onceflow.ack.failures"
	MetricDedupRows        = "onceflow.dedup.rows"
	MetricDedupExpired     = "onceflow.dedup.expired"
	MetricDedupOldestAge   = "onceflow.dedup.oldest_age"
	MetricOutboxBacklog    = "onceflow.outbox.backlog"
	MetricOutboxLag        = "onceflow.outbox.lag"
	MetricOrderParked      = "onceflow.order.parked"
	MetricOrderGapTimeouts = "onceflow.order.gap_timeouts"
	MetricOrderSweepErrors = "onceflow.order.sweep_errors"
	MetricDedupBeyond      = "onceflow.dedup.beyond_retention"
	MetricDeadLetterErrors = "onceflow.deadletter.failures"
	MetricHandlerPaused    = "onceflow.handler.paused"
)

// Instruments are the synchronous instruments shared by the Metrics middleware and the router.
// Creating them twice on one meter returns the same instruments.
type Instruments struct {
	Messages        metric.Int64Counter
	ProcessDuration metric.Float64Histogram
	Inflight        metric.Int64UpDownCounter
	Retries         metric.Int64Counter
	CommitToAck     metric.Float64Histogram
	GroupSize       metric.Int64Histogram
	AckFailures     metric.Int64Counter
	BeyondRetention metric.Int64Counter
	DeadLetterFails metric.Int64Counter
}

// LatencyBuckets are the histogram bucket boundaries, in seconds: from 100 µs to 10 s, which
// suits message processing and the commit-to-ack latency alike.
var LatencyBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// GroupSizeBuckets are the bucket boundaries of the group-size histogram, in messages: powers
// of two up to 1,024, around the default group size (64); groups above 1,024 fall in the
// overflow bucket.
var GroupSizeBuckets = []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}

// NewInstruments creates the instruments on meter.
func NewInstruments(meter metric.Meter) (*Instruments, error) {
	var ins Instruments
	var err error
	if ins.Messages, err = meter.Int64Counter(MetricMessages, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries handled, each counted once by its final outcome (processed, duplicate, dead_lettered, failed, panicked)."),
	); err != nil {
		return nil, err
	}
	if ins.ProcessDuration, err = meter.Float64Histogram(MetricProcessDuration, metric.WithUnit("s"),
		metric.WithDescription("Time from the start of the chain to its outcome, retries and their waits included."),
		metric.WithExplicitBucketBoundaries(LatencyBuckets...)); err != nil {
		return nil, err
	}
	if ins.Inflight, err = meter.Int64UpDownCounter(MetricInflight, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries being processed now.")); err != nil {
		return nil, err
	}
	if ins.Retries, err = meter.Int64Counter(MetricRetries, metric.WithUnit("{attempt}"),
		metric.WithDescription("In-process retries: processing attempts after the first, each in a fresh transaction.")); err != nil {
		return nil, err
	}
	if ins.CommitToAck, err = meter.Float64Histogram(MetricCommitToAck, metric.WithUnit("s"),
		metric.WithDescription("Time from the database commit to the acknowledgement handed to the subscriber."),
		metric.WithExplicitBucketBoundaries(LatencyBuckets...)); err != nil {
		return nil, err
	}
	if ins.GroupSize, err = meter.Int64Histogram(MetricGroupSize, metric.WithUnit("{message}"),
		metric.WithDescription("Messages whose effects one group-commit transaction committed, recorded once per committed transaction."),
		metric.WithExplicitBucketBoundaries(GroupSizeBuckets...)); err != nil {
		return nil, err
	}
	if ins.AckFailures, err = meter.Int64Counter(MetricAckFailures, metric.WithUnit("{message}"),
		metric.WithDescription("Acknowledgements that could not reach the subscriber because the delivery had already ended (ack deadline passed, subscription closed); the broker redelivers and deduplication absorbs the copy."),
	); err != nil {
		return nil, err
	}
	if ins.BeyondRetention, err = meter.Int64Counter(MetricDedupBeyond, metric.WithUnit("{message}"),
		metric.WithDescription("Messages delivered beyond the dedup retention: reason expired_key (their expired key was still recorded: a certain duplicate) or old_message (older than the retention), handled by the handler's retention policy."),
	); err != nil {
		return nil, err
	}
	if ins.DeadLetterFails, err = meter.Int64Counter(MetricDeadLetterErrors, metric.WithUnit("{message}"),
		metric.WithDescription("Messages that were to be dead-lettered but that the dead-letter broker refused under every form; they are nacked and come back after their redelivery delay."),
	); err != nil {
		return nil, err
	}
	return &ins, nil
}

// DedupGauges are the observable gauges of duplicate-detection tables, observed by a callback
// that reads the tables at collection time.
type DedupGauges struct {
	Rows      metric.Int64ObservableGauge
	Expired   metric.Int64ObservableGauge
	OldestAge metric.Float64ObservableGauge
}

// NewDedupGauges creates the gauges on meter.
func NewDedupGauges(meter metric.Meter) (*DedupGauges, error) {
	var g DedupGauges
	var err error
	if g.Rows, err = meter.Int64ObservableGauge(MetricDedupRows, metric.WithUnit("{row}"),
		metric.WithDescription("Rows of the duplicate-detection table, expired ones included.")); err != nil {
		return nil, err
	}
	if g.Expired, err = meter.Int64ObservableGauge(MetricDedupExpired, metric.WithUnit("{row}"),
		metric.WithDescription("Rows of the duplicate-detection table past their retention, waiting for the purge; growth means purging does not keep up.")); err != nil {
		return nil, err
	}
	if g.OldestAge, err = meter.Float64ObservableGauge(MetricDedupOldestAge, metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest key in the duplicate-detection table; 0 when empty. It should stay near the retention plus the purge interval.")); err != nil {
		return nil, err
	}
	return &g, nil
}

// Observables lists the gauges, for metric.Meter.RegisterCallback.
func (g *DedupGauges) Observables() []metric.Observable {
	return []metric.Observable{g.Rows, g.Expired, g.OldestAge}
}

// NewPausedGauge creates on meter the gauge of how long each handler has been paused by an
// outage.
func NewPausedGauge(meter metric.Meter) (metric.Float64ObservableGauge, error) {
	return meter.Float64ObservableGauge(MetricHandlerPaused, metric.WithUnit("s"),
		metric.WithDescription("How long the handler has been paused by an outage (the database unreachable or read-only, the dead-letter broker refusing messages); 0 while it runs."))
}

// Names of the OpenTelemetry messaging semantic-convention metrics onceflow records beside its
// own.
const (
	MetricConsumedMessages         = "messaging.client.consumed.messages"
	MetricMessagingProcessDuration = "messaging.process.duration"
)

// ConventionInstruments are the semantic-convention instruments of the Metrics middleware.
type ConventionInstruments struct {
	Consumed        metric.Int64Counter
	ProcessDuration metric.Float64Histogram
}

// NewConventionInstruments creates them on meter.
func NewConventionInstruments(meter metric.Meter) (*ConventionInstruments, error) {
	var ins ConventionInstruments
	var err error
	if ins.Consumed, err = meter.Int64Counter(MetricConsumedMessages, metric.WithUnit("{message}"),
		metric.WithDescription("Number of messages that were delivered to the application.")); err != nil {
		return nil, err
	}
	if ins.ProcessDuration, err = meter.Float64Histogram(MetricMessagingProcessDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of processing operation."),
		metric.WithExplicitBucketBoundaries(LatencyBuckets...)); err != nil {
		return nil, err
	}
	return &ins, nil
}
