package amqp

import (
	"reflect"

	amqp "github.com/rabbitmq/amqp091-go"
)

// deliveryCount returns what the broker says of d's deliveries: on a quorum queue, the count
// from the header x-delivery-count, which RabbitMQ sets on every delivery after the first to
// the number of earlier ones; on a classic queue, count 0 and the redelivered flag.
func deliveryCount(d amqp.Delivery, quorum bool) (count int, redelivered bool) {
	if quorum {
		if n, ok := countHeader(d.Headers[HeaderDeliveryCount]); ok {
			return n + 1, false
		}
		if !d.Redelivered {
			return 1, false
		}
	}
	return 0, d.Redelivered
}

// countHeader reads the x-delivery-count header, an integer that RabbitMQ sets (a string one
// comes from a producer, and is not trusted).
func countHeader(v any) (int, bool) {
	var n int64
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n = rv.Int()
	case reflect.Uint8, reflect.Uint16, reflect.Uint32:
		n = int64(rv.Uint())
	default:
		return 0, false
	}
	if n < 0 || n > 1<<31 {
		return 0, false
	}
	return int(n), true
}
