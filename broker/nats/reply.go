package nats

import (
	"math"
	"strings"
)

// numDelivered returns JetStream's delivery count of the message whose reply subject is reply,
// and false when reply is not the ack subject of a JetStream delivery. It reads the subject as
// nats.Msg.Metadata does, without the allocations of the fields it does not need:
//
//	$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>
//	$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>[.<token>...]
//
// The count is capped at math.MaxInt32; a count that is not a number reads as 0, as nats.go
// reads it.
func numDelivered(reply string) (int, bool) {
	rest, ok := strings.CutPrefix(reply, "$JS.ACK.")
	if !ok {
		return 0, false
	}
	tokens := strings.Count(rest, ".") + 3 // with $JS and ACK
	var at int                             // the index of the delivered token
	switch {
	case tokens == 9:
		at = 4
	case tokens >= 11:
		at = 6
	default:
		return 0, false
	}
	for range at - 2 {
		rest = rest[strings.IndexByte(rest, '.')+1:]
	}
	field, _, _ := strings.Cut(rest, ".")
	var n uint64
	for i := 0; i < len(field); i++ {
		c := field[i]
		if c < '0' || c > '9' {
			return 0, true // as nats.go reads a count that is not a number
		}
		n = min(n*10+uint64(c-'0'), math.MaxInt32)
	}
	return int(n), true
}
