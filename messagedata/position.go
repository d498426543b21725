package messagedata

import (
	"fmt"
	"strconv"
)

// The headers that say where a message sits in an ordered log (a Kafka partition), written by
// the subscriber from what the broker says, never taken from the producer.
const (
	// HeaderPartition is the partition the message was consumed from.
	HeaderPartition = "onceflow_partition"
	// HeaderOffset is the message's offset in its partition.
	HeaderOffset = "onceflow_offset"
	// HeaderPreviousOffset is the offset of the last message before this one in the same
	// partition that the subscriber holds and that was not acknowledged when it handed this
	// one out, or -1 when there is none: the message the consumer must apply before this one.
	// Messages before it that were acknowledged (applied, duplicates, dead-lettered) or that
	// the subscriber never took (it started after them) need nothing more.
	HeaderPreviousOffset = "onceflow_previous_offset"
)

// Position is where a message sits in an ordered log.
type Position struct {
	// Partition is the partition the message was consumed from.
	Partition int32
	// Offset is the message's offset in its partition.
	Offset int64
	// Previous is the offset of the last message before it in the same partition that was not
	// acknowledged when the subscriber handed it out, or -1 for none (HeaderPreviousOffset).
	Previous int64
}

// PositionOf returns the position of m in its ordered log, and false when its headers say
// none: its broker has no partitions. A header that is present but malformed is an error.
func PositionOf(m *MessageData) (Position, bool, error) {
	part, off := m.Header(HeaderPartition), m.Header(HeaderOffset)
	if part == "" && off == "" {
		return Position{}, false, nil
	}
	var p Position
	n, err := strconv.ParseInt(part, 10, 32)
	if err != nil || n < 0 {
		return p, false, fmt.Errorf("header %s holds %q, not a partition number", HeaderPartition, part)
	}
	p.Partition = int32(n)
	if p.Offset, err = strconv.ParseInt(off, 10, 64); err != nil || p.Offset < 0 {
		return p, false, fmt.Errorf("header %s holds %q, not an offset", HeaderOffset, off)
	}
	p.Previous = -1
	if prev := m.Header(HeaderPreviousOffset); prev != "" {
		if p.Previous, err = strconv.ParseInt(prev, 10, 64); err != nil || p.Previous < -1 || p.Previous >= p.Offset {
			return p, false, fmt.Errorf("header %s holds %q, not an offset below %d", HeaderPreviousOffset, prev, p.Offset)
		}
	}
	return p, true, nil
}

// Headers returns the headers that carry p.
func (p Position) Headers() map[string]string {
	h := make(map[string]string, 3)
	p.SetHeaders(h)
	return h
}

// SetHeaders writes the headers that carry p into headers, replacing what they held: for a
// subscriber, which writes what the broker says whatever the producer wrote.
func (p Position) SetHeaders(headers map[string]string) {
	headers[HeaderPartition] = strconv.FormatInt(int64(p.Partition), 10)
	headers[HeaderOffset] = strconv.FormatInt(p.Offset, 10)
	headers[HeaderPreviousOffset] = strconv.FormatInt(p.Previous, 10)
}
