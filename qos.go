package onceflow

import (
	"fmt"
	"strings"
)

// QoS is a quality of service: what a handler guarantees about each message's effect, in seed
// 003's names. The router builds the middleware chain for it.
type QoS int

// The qualities of service. The zero value is not valid: a handler must choose.
const (
	// BestEffort acknowledges a message on receipt, then processes it in a transaction. A crash
	// or an error after the ack loses the message. A handler acks a message only once one of
	// its Concurrency slots is free, so it processes no more messages at once than the other
	// levels. It exists to show, by measurement, what early acknowledgement costs.
	BestEffort QoS = iota + 1
	// AtLeastOnce processes each message in a transaction and acknowledges it after the commit,
	// without duplicate detection: nothing is lost, and a redelivery after a commit (a crash
	// between commit and ack) applies the effect twice.
	AtLeastOnce
	// ExactlyOnce adds duplicate detection in the same transaction: the message id is recorded
	// with the business writes, so a redelivered message is recognised and acknowledged without
	// being processed again. Each message's effect is in the database exactly once.
	ExactlyOnce
	// ExactlyOnceInOrder is ExactlyOnce plus per-key ordering: messages with the same ordering
	// key are applied in the order of their sequence numbers.
	ExactlyOnceInOrder
)

var qosNames = map[QoS]string{
	BestEffort:         "BestEffort",
	AtLeastOnce:        "AtLeastOnce",
	ExactlyOnce:        "ExactlyOnce",
	ExactlyOnceInOrder: "ExactlyOnceInOrder",
}

// String returns the name of q, such as "ExactlyOnce".
func (q QoS) String() string {
	if s, ok := qosNames[q]; ok {
		return s
	}
	return fmt.Sprintf("QoS(%d)", int(q))
}

// Valid reports whether q is one of the defined qualities of service.
func (q QoS) Valid() bool { _, ok := qosNames[q]; return ok }

// ParseQoS returns the QoS named s, ignoring case and the characters '-' and '_'
// ("exactly-once" and "ExactlyOnce" both work).
func ParseQoS(s string) (QoS, error) {
	norm := strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(s))
	for q, name := range qosNames {
		if strings.ToLower(name) == norm {
			return q, nil
		}
	}
	return 0, fmt.Errorf("unknown quality of service %q (want BestEffort, AtLeastOnce, ExactlyOnce or ExactlyOnceInOrder)", s)
}
