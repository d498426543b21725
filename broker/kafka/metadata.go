package kafka

import (
	"strconv"
	"strings"
)

// A member of onceflow's consumer groups commits, with each partition's offset, metadata that
// says what the offset alone cannot:
//
//	onceflow taken <offset> [acked <from>-<to>,<from>-<to>...]
//
// taken is the offset after the last record the member may have handed out: a member that
// takes the partition over counts the deliveries of the records below it as unknown. The
// acked spans are the records at or after the committed offset that are acked already,
// behind one that is not (Kafka commits a position; these were processed and committed in
// the database, their acknowledgements given): a member that takes the partition over does
// not deliver them again. At most maxSpans are kept (Kafka keeps 4096 bytes of metadata by
// default); the records of the spans left out are delivered again, which deduplication
// absorbs.

// metadataPrefix starts the commit metadata of onceflow's members.
const metadataPrefix = "onceflow taken "

// maxSpans bounds the acked spans of one partition's commit metadata.
const maxSpans = 64

// span is a run of acked offsets, from and to included.
type span struct{ from, to int64 }

// groupMetadata is what a commit's metadata says of a partition.
type groupMetadata struct {
	taken int64
	acked []span
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
	return b.String()
}

// parseMetadata reads commit metadata that encode wrote; ok is false for any other (a group
// committed by another client).
func parseMetadata(s string) (md groupMetadata, ok bool) {
	rest, ok := strings.CutPrefix(s, metadataPrefix)
	if !ok {
		return md, false
	}
	taken, spans, _ := strings.Cut(rest, " acked ")
	n, err := strconv.ParseInt(taken, 10, 64)
	if err != nil || n < 0 {
		return groupMetadata{}, false
	}
	md.taken = n
	if spans == "" {
		return md, true
	}
	for sp := range strings.SplitSeq(spans, ",") {
		a, b, found := strings.Cut(sp, "-")
		from, err1 := strconv.ParseInt(a, 10, 64)
		to, err2 := strconv.ParseInt(b, 10, 64)
		if !found || err1 != nil || err2 != nil || from < 0 || to < from {
			return groupMetadata{taken: n}, true // the spans are lost, not the rest
		}
		md.acked = append(md.acked, span{from, to})
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
