package kafka

import (
	"maps"
	"slices"
	"strconv"
	"strings"
)

// A member of onceflow's consumer groups commits, with each partition's offset, metadata that
// says what the offset alone cannot:
//
//	onceflow taken <offset> [acked <from>-<to>,...] [counts <offset>:<n>,...]
//
// taken is the offset after the last record the member may have handed out: a member that
// takes the partition over counts the records below it as handed out once. counts are the
// records not acked that were handed out n times (n >= 2), the last perhaps in progress: the
// next member goes on from n. A member commits both before the hand-outs they cover. The
// acked spans are the records at or after the committed offset that are acked already,
// behind one that is not (Kafka commits a position; these were processed and committed in
// the database, their acknowledgements given): a member that takes the partition over does
// not deliver them again. At most maxSpans are kept (Kafka keeps 4096 bytes of metadata by
// default); the records of the spans left out are delivered again, which deduplication
// absorbs, and so are maxSpans counts, the lowest offsets first; a record whose count is left
// out counts as handed out once.

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
	for i, s := range md.acked {
		if i == maxSpans {
			break
		}
		if i == 0 {
			b.WriteString(" acked ")
		} else {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(s.from, 10))
		b.WriteByte('-')
		b.WriteString(strconv.FormatInt(s.to, 10))
	}
	offsets := slices.Sorted(maps.Keys(md.counts))
	for i, o := range offsets {
		if i == maxSpans {
			break
		}
		if i == 0 {
			b.WriteString(" counts ")
		} else {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(o, 10))
		b.WriteByte(':')
		b.WriteString(strconv.Itoa(md.counts[o]))
	}
	return b.String()
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
	for sp := range strings.SplitSeq(spans, ",") {
		if sp == "" {
			continue
		}
		a, b, found := strings.Cut(sp, "-")
		from, err1 := strconv.ParseInt(a, 10, 64)
		to, err2 := strconv.ParseInt(b, 10, 64)
		if !found || err1 != nil || err2 != nil || from < 0 || to < from {
			md.acked = nil // the spans are lost, not the rest
			break
		}
		md.acked = append(md.acked, span{from, to})
	}
	for c := range strings.SplitSeq(counts, ",") {
		if c == "" {
			continue
		}
		a, b, found := strings.Cut(c, ":")
		o, err1 := strconv.ParseInt(a, 10, 64)
		k, err2 := strconv.Atoi(b)
		if !found || err1 != nil || err2 != nil || o < 0 || k < 1 {
			md.counts = nil
			break
		}
		if md.counts == nil {
			md.counts = map[int64]int{}
		}
		md.counts[o] = k
	}
	return md, true
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
