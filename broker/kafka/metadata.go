package kafka

import (
	"maps"
	"slices"
	"strconv"
	"strings"
)

// A member of onceflow's consumer groups commits, with each partition's offset, metadata that
// says what the offset alone cannot (the package documentation's Delivery counts):
//
//	onceflow taken <offset> [acked <from>-<to>,...] [counts <offset>:<n>,...]
//
// taken is the offset after the last record the member may have handed out: the next member
// counts the records below it as handed out once. counts are the records not acked that were
// handed out n times (n >= 2), the last perhaps in progress. A member commits both before the
// hand-outs they cover. The acked spans are the records at or after the committed offset that
// are acked, behind one that is not. At most maxSpans spans and maxSpans counts, the lowest
// offsets first, are kept (Kafka keeps 4096 bytes of metadata by default): the records of the
// spans left out are delivered again, which deduplication absorbs, and a record whose count is
// left out counts as handed out once.

// metadataPrefix starts the commit metadata of onceflow's members.
const metadataPrefix = "onceflow taken "

// maxSpans bounds the acked spans of one partition's commit metadata.
const maxSpans = 64

// span is a run of acked offsets, from and to included.
type span struct{ from, to int64 }

// groupMetadata is what a commit's metadata says of a partition.
type groupMetadata struct {
	taken  int64
	acked  []span
	counts map[int64]int
}

// encode returns the commit metadata of md.
func (md groupMetadata) encode() string {
	var b strings.Builder
	b.WriteString(metadataPrefix)
	b.WriteString(strconv.FormatInt(md.taken, 10))
	writeList(&b, " acked ", md.acked, func(s span) string {
		return strconv.FormatInt(s.from, 10) + "-" + strconv.FormatInt(s.to, 10)
	})
	writeList(&b, " counts ", slices.Sorted(maps.Keys(md.counts)), func(o int64) string {
		return strconv.FormatInt(o, 10) + ":" + strconv.Itoa(md.counts[o])
	})
	return b.String()
}

// writeList writes label and the first maxSpans of items, comma-separated, if there are any.
func writeList[T any](b *strings.Builder, label string, items []T, format func(T) string) {
	for i, it := range items[:min(len(items), maxSpans)] {
		if i == 0 {
			b.WriteString(label)
		} else {
			b.WriteByte(',')
		}
		b.WriteString(format(it))
	}
}

// parseMetadata reads commit metadata that encode wrote; ok is false for any other (a group
// committed by another client).
func parseMetadata(s string) (md groupMetadata, ok bool) {
	rest, ok := strings.CutPrefix(s, metadataPrefix)
	if !ok {
		return md, false
	}
	rest, counts, _ := strings.Cut(rest, " counts ")
	taken, spans, _ := strings.Cut(rest, " acked ")
	n, err := strconv.ParseInt(taken, 10, 64)
	if err != nil || n < 0 {
		return groupMetadata{}, false
	}
	md.taken = n
	// A list that does not parse is lost, not the rest.
	if !parseList(spans, "-", func(from, to int64) bool {
		md.acked = append(md.acked, span{from, to})
		return to >= from
	}) {
		md.acked = nil
	}
	if !parseList(counts, ":", func(o, k int64) bool {
		if md.counts == nil {
			md.counts = map[int64]int{}
		}
		md.counts[o] = int(k)
		return k >= 1
	}) {
		md.counts = nil
	}
	return md, true
}

// parseList calls add with the two non-negative integers of each comma-separated pair of s,
// written a<sep>b, and reports false as soon as a pair does not parse or add refuses it.
func parseList(s, sep string, add func(a, b int64) bool) bool {
	for pair := range strings.SplitSeq(s, ",") {
		if pair == "" {
			continue
		}
		x, y, found := strings.Cut(pair, sep)
		a, err1 := strconv.ParseInt(x, 10, 64)
		b, err2 := strconv.ParseInt(y, 10, 64)
		if !found || err1 != nil || err2 != nil || a < 0 || b < 0 || !add(a, b) {
			return false
		}
	}
	return true
}

// contains reports whether offset is in one of spans.
func contains(spans []span, offset int64) bool {
	for _, s := range spans {
		if s.from <= offset && offset <= s.to {
			return true
		}
	}
	return false
}
