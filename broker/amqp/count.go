package amqp

import (
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// This file reads a delivery's count from what RabbitMQ sends with it.

// deliveryInfo returns what the broker says of d's deliveries: on a quorum queue, the count
// from the header x-delivery-count, which RabbitMQ sets on every delivery after the first to
// the number of earlier ones; on a classic queue, the redelivered flag.
func deliveryInfo(d amqp.Delivery, quorum bool) redelivery.Info {
	info := redelivery.Info{DelaysNacks: true}
	if quorum {
		if n, ok := deliveryCount(d.Headers[HeaderDeliveryCount]); ok {
			info.Count = n + 1
			return info
		}
		if !d.Redelivered {
			info.Count = 1
			return info
		}
	}
	info.Redelivered = d.Redelivered
	return info
}

// deliveryCount reads the x-delivery-count header, an integer that RabbitMQ sets (a string one
// comes from a producer, and is not trusted).
func deliveryCount(v any) (int, bool) {
	var n int64
	switch v := v.(type) {
	case int64:
		n = v
	case int32:
		n = int64(v)
	case int16:
		n = int64(v)
	case int8:
		n = int64(v)
	case int:
		n = int64(v)
	case uint8:
		n = int64(v)
	case uint16:
		n = int64(v)
	case uint32:
		n = int64(v)
	default:
		return 0, false
	}
	if n < 0 || n > 1<<31 {
		return 0, false
	}
	return int(n), true
}
