package outbox

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/internal/telemetry"
)

// Attribute keys of the outbox gauges.
const (
	// AttrOutbox is the outbox's name (Config.Table).
	AttrOutbox = attribute.Key("onceflow.outbox")
	// AttrConsumerGroup is the relays' consumer group.
	AttrConsumerGroup = attribute.Key("onceflow.outbox.consumer_group")
)

// RegisterMetrics registers two observable gauges on meter, observed with Stats at each
// collection, with the attributes onceflow.outbox (the table) and
// onceflow.outbox.consumer_group:
//
//	onceflow.outbox.backlog  {message}  committed messages the group has not sent (Stats.Backlog)
//	onceflow.outbox.lag      s          age of the oldest of them, 0 when none (Stats.Lag)
//
// The gauges read the database, not the relay's state, so any process may register them,
// whether the relay runs there or not. A failed read is reported to the meter provider's
// error handler and skips that collection. Unregister the returned registration to stop.
func (r *Relay) RegisterMetrics(meter metric.Meter) (metric.Registration, error) {
	backlog, err := meter.Int64ObservableGauge(telemetry.MetricOutboxBacklog, metric.WithUnit("{message}"),
		metric.WithDescription("Committed outbox messages that the relays of the consumer group have not sent yet."))
	if err != nil {
		return nil, fmt.Errorf("outbox: create gauge %s: %w", telemetry.MetricOutboxBacklog, err)
	}
	lag, err := meter.Float64ObservableGauge(telemetry.MetricOutboxLag, metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest outbox message that the relays of the consumer group have not sent yet; 0 when none waits."))
	if err != nil {
		return nil, fmt.Errorf("outbox: create gauge %s: %w", telemetry.MetricOutboxLag, err)
	}
	attrs := metric.WithAttributeSet(attribute.NewSet(AttrOutbox.String(r.cfg.Table), AttrConsumerGroup.String(r.cfg.ConsumerGroup)))
	reg, err := meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		st, err := r.Stats(ctx)
		if err != nil {
			return err
		}
		o.ObserveInt64(backlog, st.Backlog, attrs)
		o.ObserveFloat64(lag, st.Lag.Seconds(), attrs)
		return nil
	}, backlog, lag)
	if err != nil {
		return nil, fmt.Errorf("outbox: register the gauges' callback: %w", err)
	}
	return reg, nil
}
